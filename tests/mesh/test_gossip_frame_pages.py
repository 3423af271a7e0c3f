"""A GossipFrame never lists more than MAX_PEERS_PER_FRAME nodes, however large the table.

A frame listing more is refused as malformed, and frames once carried the whole
table: from the 256th peer on, every member's every frame was refused, and gossip
stopped for the whole mesh. Now a table too large for one frame goes out in pages
that successive frames continue.
"""

import time

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.store import MembershipState
from meshnode.mesh.signed_record import VerifiedRecord, decode_record, sign_record
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import MAX_PEERS_PER_FRAME, validate_gossip_frame
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh

NOW = time.time()


def state_with_peers(peers: int) -> MeshState:
    mesh_key = MeshKey.generate()
    identity = NodeIdentity.generate()
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=NOW
    )
    state = MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1, addresses=["127.0.0.1:1"]),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
    )
    records = []
    for _ in range(peers):
        peer = NodeIdentity.generate()
        announcement = mesh.PeerAnnouncement(endpoint_id=peer.node_id, incarnation=1, mesh_id=state.mesh_id)
        signed = sign_record(peer, announcement)
        records.append(VerifiedRecord(decode_record(signed), signed))
    state.table.merge(records, from_peer=records[0].node_id, now_ns=SECOND_NS)
    return state


def listed(frame: mesh.GossipFrame) -> list[bytes]:
    return [bytes(decode_record(e.record).endpoint_id) for e in frame.entries]


def test_a_table_that_fits_goes_whole_in_every_frame():
    state = state_with_peers(MAX_PEERS_PER_FRAME - 1)
    frame = state.gossip_frame(b"v" * 32)
    assert len(frame.entries) == MAX_PEERS_PER_FRAME
    assert set(listed(frame)) == {state.node_id, *state.table.peer_ids()}


def test_a_larger_table_goes_in_pages_each_a_valid_frame_and_all_of_it_in_turn():
    state = state_with_peers(600)
    seen: set[bytes] = set()
    for _ in range(3):  # 255 others a frame: three frames cover 600
        frame = state.gossip_frame(b"v" * 32)
        validate_gossip_frame(frame, state.node_id)  # not refused as malformed
        ids = listed(frame)
        assert len(ids) == MAX_PEERS_PER_FRAME
        assert ids[0] == state.node_id  # the sender's own record, which a receiver needs, comes first
        seen.update(ids[1:])
    assert seen == set(state.table.peer_ids())
