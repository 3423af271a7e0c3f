"""What the addresses relays observe say of this node's NAT (pure).

Registrations leave from the node's mesh socket, so each relay sees the address and port the
node's NAT mapped that one socket to. Two relays that see different ports mean a mapping per
destination (a symmetric NAT): a peer punching to the port one relay saw reaches nothing. One
relay alone cannot tell; a relay that sees the socket's own address means there is no NAT.
"""

from __future__ import annotations

from collections.abc import Collection

from meshnode.transport.addresses import AddressError, format_host_port, parse_host_port
from meshnode.wire.pb import mesh


def classify_mapping(observed: Collection[str], local_addresses: Collection[str]) -> mesh.NatMapping:
    """The ``NatMapping`` of a socket that its relays observe at ``observed`` (``host:port`` by
    relay, one each) and that this machine announces as ``local_addresses``."""
    seen: list[tuple[str, int]] = []
    for address in observed:
        try:
            seen.append(parse_host_port(address))
        except AddressError:
            continue
    if not seen:
        return mesh.NAT_MAPPING_UNKNOWN
    if any(format_host_port(host, port) in local_addresses for host, port in seen):
        return mesh.NAT_MAPPING_NONE
    if len({port for _host, port in seen}) > 1:
        return mesh.NAT_MAPPING_ENDPOINT_DEPENDENT
    # Two relays (two destinations) saw one port: the mapping does not follow the destination.
    return mesh.NAT_MAPPING_ENDPOINT_INDEPENDENT if len(seen) > 1 else mesh.NAT_MAPPING_UNKNOWN


_NAMES: dict[int, str] = {
    mesh.NAT_MAPPING_UNKNOWN: "unknown",
    mesh.NAT_MAPPING_NONE: "no NAT",
    mesh.NAT_MAPPING_ENDPOINT_INDEPENDENT: "endpoint-independent",
    mesh.NAT_MAPPING_ENDPOINT_DEPENDENT: "endpoint-dependent",
}


def mapping_name(mapping: int) -> str:
    """``endpoint-independent`` etc., for status and logs."""
    return _NAMES.get(mapping, "unknown")


def punchable(mapping: int) -> bool:
    """Whether a peer can punch to a node whose NAT maps so (unknown is tried: most home routers
    map independently of the destination)."""
    return mapping != mesh.NAT_MAPPING_ENDPOINT_DEPENDENT


__all__ = ["classify_mapping", "mapping_name", "punchable"]
