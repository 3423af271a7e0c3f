"""Which addresses a punch offers and dials, which a peer's direct link came by, and the LAN
shortcut (pure).

A member is authenticated, not trusted: a candidate from a peer's offer is dialled only if that
peer's own signed record announces it (its ``addresses`` or ``observed_addresses``), so no member
can make this node send to hosts of its choosing through the punch.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable

from meshnode.transport.addresses import AddressError, parse_host_port
from meshnode.wire.pb import mesh

# Addresses one offer may carry, and one record may announce of each kind (validation's caps).
MAX_CANDIDATES = 8


class PathKind(enum.Enum):
    """How a link to a peer goes."""

    RELAYED = "relayed"
    # Dialled at an address the peer announces as reachable (a public one).
    PUBLIC = "public"
    # To a peer behind NAT at its private address: the same LAN, or a private network shared.
    LAN = "lan"
    # Through both NATs, opened by a punch.
    PUNCHED = "punched"

    @property
    def traversed(self) -> bool:
        """A direct path to a peer behind NAT, which the relay stands in for when it dies."""
        return self in (PathKind.LAN, PathKind.PUNCHED)


def own_candidates(observed: Iterable[str], announced: Iterable[str]) -> list[str]:
    """What this node offers a peer: where relays see its socket first (what a peer behind
    another NAT can reach), then what it announces; no repeats, at most MAX_CANDIDATES."""
    offered: list[str] = []
    for address in (*observed, *announced):
        if address not in offered:
            offered.append(address)
    return offered[:MAX_CANDIDATES]


def vouched_candidates(offered: Iterable[str], record: mesh.PeerAnnouncement | None) -> list[str]:
    """Of a peer's ``offered`` candidates, those its own signed ``record`` announces."""
    if record is None:
        return []
    announced = {*record.addresses, *record.observed_addresses}
    vouched: list[str] = []
    for address in offered:
        if address in announced and address not in vouched:
            vouched.append(address)
    return vouched[:MAX_CANDIDATES]


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        host, _port = parse_host_port(address)
        return ipaddress.ip_address(host.split("%", 1)[0])
    except (AddressError, ValueError):
        return None


def _hosts(addresses: Iterable[str]) -> set[str]:
    return {str(ip) for ip in map(_ip, addresses) if ip is not None}


def _same_network(
    a: ipaddress.IPv4Address | ipaddress.IPv6Address, b: ipaddress.IPv4Address | ipaddress.IPv6Address
) -> bool:
    # Interfaces' masks are not announced: a /24 (IPv4) or /64 (IPv6) is what home LANs use.
    if a.version != b.version:
        return False
    prefix = 24 if a.version == 4 else 64
    return a in ipaddress.ip_network(f"{b}/{prefix}", strict=False)


def lan_addresses(local: mesh.PeerAnnouncement, peer: mesh.PeerAnnouncement | None) -> list[str]:
    """The private addresses to dial a peer behind NAT at, beside its relay: it shares this node's
    public address (one router, so one LAN), or, where relays have not seen both of them, it
    announces an address in a private network this node's own addresses are in (two homes behind
    different routers often number their LANs alike: relays that see them at different public
    addresses rule that out). Empty for a directly reachable peer (its addresses are dialled
    anyway) and for one that shares nothing with this node."""
    if peer is None or peer.directly_reachable:
        return []
    ours, theirs = _hosts(local.observed_addresses), _hosts(peer.observed_addresses)
    same_router = bool(ours & theirs)
    elsewhere = bool(ours and theirs) and not same_router
    own = [ip for ip in map(_ip, local.addresses) if ip is not None and ip.is_private]
    found: list[str] = []
    for address in peer.addresses:
        ip = _ip(address)
        if ip is None or not ip.is_private or ip.is_loopback or ip.is_link_local or elsewhere:
            continue
        if same_router or any(_same_network(ip, mine) for mine in own):
            found.append(address)
    return found[:MAX_CANDIDATES]


def worth_dialing(
    candidates: Iterable[str], local: mesh.PeerAnnouncement, peer: mesh.PeerAnnouncement | None
) -> list[str]:
    """Of a peer's vouched ``candidates``, those that can lead somewhere from here: where relays
    see it, any address of a directly reachable peer or a public one, and its private addresses
    only where it shares this node's LAN (:func:`lan_addresses`): a private address elsewhere is
    some other network's."""
    if peer is None:
        return []
    lan = set(lan_addresses(local, peer))
    found = []
    for address in candidates:
        ip = _ip(address)
        if (
            address in peer.observed_addresses
            or address in lan
            or peer.directly_reachable
            or (ip is not None and ip.is_global)
        ):
            found.append(address)
    return found


def classify_path(
    *, relayed: bool, remote: str, punched: bool, peer: mesh.PeerAnnouncement | None
) -> PathKind:
    """How a link goes: ``remote`` is the address its datagrams come from (``host:port``),
    ``punched`` whether this node made or took it in a punch."""
    if relayed:
        return PathKind.RELAYED
    if peer is None or peer.directly_reachable:
        return PathKind.PUNCHED if punched else PathKind.PUBLIC
    if remote in peer.addresses:
        return PathKind.LAN
    return PathKind.PUNCHED if punched or remote in peer.observed_addresses else PathKind.PUBLIC


__all__ = [
    "MAX_CANDIDATES",
    "PathKind",
    "classify_path",
    "lan_addresses",
    "own_candidates",
    "vouched_candidates",
    "worth_dialing",
]
