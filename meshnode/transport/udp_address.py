"""The socket address a UDP endpoint sends a peer's datagrams to, shaped for the endpoint's socket.

aioquic matches every datagram it receives to a connection's network path by comparing
addresses as Python values, and an IPv6 socket reports its senders as
``(host, port, flowinfo, scope_id)``: a connection dialed at ``("::1", port)`` never sees
its handshake answered. On a dual-stack socket (``[::]:PORT``) an IPv4 peer is
``::ffff:a.b.c.d``. So the address dialed must be the one the socket will report.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import cast

from meshnode.transport.addresses import format_host_port, parse_host_port

SockAddr = tuple[str, int] | tuple[str, int, int, int]


class FamilyMismatch(ValueError):
    """The peer's address is IPv6 and this endpoint's socket IPv4-only."""


def sockaddr_for(family: int, host: str, port: int) -> SockAddr:
    """``host`` (an IP literal, an IPv6 one with an optional ``%scope``) and ``port`` as the
    address a UDP socket of ``family`` sends to and reports datagrams from. Raises ValueError
    for a host that is not an IP literal, :class:`FamilyMismatch` for IPv6 on an IPv4 socket."""
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        return (f"::ffff:{ip}", port, 0, 0) if family == socket.AF_INET6 else (str(ip), port)
    if family != socket.AF_INET6:
        raise FamilyMismatch(
            f"{host} is an IPv6 address and this node listens on IPv4 only "
            "(listen on [::]:PORT to reach IPv6 and IPv4 peers)"
        )
    if ip.ipv4_mapped is not None:
        # As the kernel writes it (::ffff:10.0.0.1), not as Python does (::ffff:a00:1).
        return (f"::ffff:{ip.ipv4_mapped}", port, 0, 0)
    # getaddrinfo turns a scope name (fe80::1%eth0) into the interface index the socket needs.
    info = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
    # An AF_INET6 answer's address has four fields (host, port, flowinfo, scope id).
    sockaddr = cast(tuple[str, int, int, int], info[0][4])
    return (str(sockaddr[0]), int(sockaddr[1]), int(sockaddr[2]), int(sockaddr[3]))


def local_host_to_reach(address: str, local_host: str = "0.0.0.0") -> str:
    """Where a socket that dials only ``address`` (``host:port``) binds: the IPv6 wildcard for
    an IPv6 literal where ``local_host`` is the IPv4 one, else ``local_host``."""
    if local_host != "0.0.0.0":
        return local_host
    try:
        host, _ = parse_host_port(address)
        is_ipv6 = ipaddress.ip_address(host).version == 6
    except ValueError:  # a name, or no address at all: the dial says what is wrong
        return local_host
    return "::" if is_ipv6 else local_host


def describe_sockaddr(addr: SockAddr) -> str:
    """``host:port`` for people: an IPv4 peer of a dual-stack socket as plain IPv4."""
    host, port = str(addr[0]), int(addr[1])
    try:
        mapped = ipaddress.ip_address(host)
    except ValueError:
        return format_host_port(host, port)
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        host = str(mapped.ipv4_mapped)
    return format_host_port(host, port)


__all__ = ["FamilyMismatch", "SockAddr", "describe_sockaddr", "local_host_to_reach", "sockaddr_for"]
