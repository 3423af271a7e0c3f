"""The peer addresses a member stores, to find the mesh again when it restarts.

What the peer table lists now comes first, with the first address each peer announces now;
then the peers it removed (left, or dropped as failed) and has not listed again, the latest
first, at the address they last announced; then the ones stored before. So peers that
stopped are kept: a mesh stopped node by node would otherwise leave the node stopped last
knowing nobody, and if it is the one every invite named and the others come back, or it
comes back on another address, the mesh restarts in pieces. Removed members are dropped (no
one admits them), and the node itself. The freshest ``limit`` are kept. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshnode.membership.credentials import Endpoint
from meshnode.membership.revocation import RevocationList
from meshnode.mesh.peer_table import PeerTable


def peers_to_remember(
    table: PeerTable, stored: Iterable[Endpoint], *, revocations: RevocationList, limit: int
) -> list[Endpoint]:
    """Each peer once, at its freshest address, none revoked, at most ``limit``."""
    listed = (
        Endpoint(entry.peer_id, entry.announcement.addresses[0])
        for entry in table.entries()
        if entry.announcement.addresses
    )
    removed = (Endpoint(peer_id, address) for peer_id, address in table.departed())
    kept: list[Endpoint] = []
    seen = {table.self_id}
    for endpoint in (*listed, *removed, *stored):
        if endpoint.id in seen or revocations.node(endpoint.id) is not None:
            continue
        seen.add(endpoint.id)
        kept.append(endpoint)
        if len(kept) == limit:
            break
    return kept


__all__ = ["peers_to_remember"]
