"""The head's candidate index: candidates as shard_candidates builds them, each built again only
when its node's signed record changed, and a node gone from the table gone from them."""

from meshnode.head.candidates import CandidateIndex, shard_candidates
from meshnode.identity import NodeIdentity
from meshnode.mesh.peer_table import PeerEntry
from meshnode.mesh.signed_record import sign_record
from meshnode.wire.pb import mesh

IDENTITIES = [NodeIdentity.from_seed(bytes([n]) * 32) for n in range(1, 5)]


def entry(identity: NodeIdentity, *, start: int, sessions: int = 0, seq: int = 0) -> PeerEntry:
    announcement = mesh.PeerAnnouncement(endpoint_id=identity.node_id, incarnation=1, heartbeat_seq=seq)
    if start >= 0:
        served = announcement.serving
        served.model_name = "m"
        served.total_layers = 8
        served.shard_range.start_layer, served.shard_range.end_layer = start, start + 4
        served.fingerprint.model_artifact_digest = "sha256:a"
        served.fingerprint.runtime_recipe_digest = "sha256:r"
        announcement.load.active_sessions = sessions
    return PeerEntry(announcement, sign_record(identity, announcement), first_seen_ns=0, last_heard_ns=0)


def test_candidates_are_built_again_only_for_changed_records():
    a, b, c, d = IDENTITIES
    table = [entry(a, start=0), entry(b, start=4), entry(c, start=-1), entry(d, start=4)]
    index = CandidateIndex()
    first = index.candidates(table)
    assert first == shard_candidates([(e.peer_id, e.announcement) for e in table])
    assert [x.node_id for x in first] == [a.node_id, b.node_id, d.node_id]
    # b's record changes (a fresher one, signed again); d leaves the table.
    table = [table[0], entry(b, start=4, sessions=3, seq=1), table[2]]
    second = index.candidates(table)
    assert second[0] is first[0]
    assert second[1].active_sessions == 3 and second[1] is not first[1]
    assert [x.node_id for x in second] == [a.node_id, b.node_id]
    # d back with the record it had: built again (it was forgotten), equal to what it was.
    table.append(entry(d, start=4))
    assert index.candidates(table)[2] == first[2]
