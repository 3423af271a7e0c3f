"""The addresses a node listening on a wildcard tells its peers to dial.

A socket bound to ``0.0.0.0`` or ``[::]`` names no address peers could use; the
address the kernel would send from towards the outside world is the best guess
(``--advertise`` overrides it). A dual-stack socket is reachable over both
families, so it advertises an address of each this machine routes: an IPv6-only
host must not advertise an IPv4 loopback.
"""

from __future__ import annotations

import contextlib
import socket

from meshnode.transport.addresses import format_host_port

# Documentation prefixes (TEST-NET-1, 2001:db8::/32): a connect() only looks up the route.
_ROUTE_PROBES: dict[int, tuple[str, int]] = {
    socket.AF_INET: ("192.0.2.1", 9),
    socket.AF_INET6: ("2001:db8::1", 9),
}


def outbound_address(family: int) -> str | None:
    """This machine's source address towards the outside world over ``family``, or None where
    it has no route (no packet is sent)."""
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(_ROUTE_PROBES[family])
        return str(probe.getsockname()[0])
    return None


def advertised_hosts(bound_host: str, ipv4: str | None, ipv6: str | None) -> list[str]:
    """The hosts to advertise for a socket bound to ``bound_host``, given this machine's
    outbound ``ipv4`` and ``ipv6`` addresses (None: no route); IPv4 first."""
    if bound_host == "0.0.0.0":
        return [ipv4 or "127.0.0.1"]
    if bound_host == "::":
        return [host for host in (ipv4, ipv6) if host] or ["::1"]
    return [bound_host]


def default_advertised(bound_host: str, bound_port: int) -> list[str]:
    """``host:port`` addresses peers should dial a node bound to ``bound_host:bound_port`` at."""
    wildcard = bound_host in ("0.0.0.0", "::")
    ipv4 = outbound_address(socket.AF_INET) if wildcard else None
    ipv6 = outbound_address(socket.AF_INET6) if bound_host == "::" else None
    return [format_host_port(host, bound_port) for host in advertised_hosts(bound_host, ipv4, ipv6)]


__all__ = ["advertised_hosts", "default_advertised", "outbound_address"]
