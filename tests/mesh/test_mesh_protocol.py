"""Pure membership protocol: decision rules, validators, peer table, MeshState."""

from functools import partial

import pytest

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    create_invite,
    issue_certificate,
)
from meshnode.membership.revocation import revoke_invite, revoke_node
from meshnode.membership.store import MembershipState
from meshnode.mesh.gossip_records import open_gossip_entries
from meshnode.mesh.peer_table import PeerTable
from meshnode.mesh.rules import (
    Freshness,
    LinkCandidate,
    MergeAction,
    PeerDownAction,
    PeerLeavingAction,
    keep_new_link,
    resolve_announcement,
    resolve_peer_down,
    resolve_peer_leaving,
    stream_allowed_before_admission,
)
from meshnode.mesh.signed_record import RecordFault, VerifiedRecord, sign_record
from meshnode.mesh.state import HeartbeatDue, MeshState, PeerStale
from meshnode.mesh.validation import (
    MAX_PEERS_PER_FRAME,
    decode,
    validate_gossip_frame,
    validate_peer_down,
    validate_peer_leaving,
    validate_probe,
    validate_route_request,
)
from meshnode.sansio import SECOND_NS
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal, refusal_from_reset_code, reset_code
from meshnode.wire.pb import mesh

# Real keys (from fixed seeds): every gossiped record is signed by the node it names.
IDENTITIES = {i.node_id: i for i in (NodeIdentity.from_seed(bytes([n]) * 32) for n in range(1, 20))}
A, B, C, *MORE = sorted(IDENTITIES)  # A < B < C, as the tie-break tests assume
NOW = 1_800_000_000.0  # unix time, which credentials and incarnations are checked against
# An instant of the monotonic clock that liveness runs on (its origin is arbitrary).
MONOTONIC_NS = 42 * SECOND_NS


def code_of(call):
    with pytest.raises(MeshRefusal) as info:
        call()
    return info.value.code


def announcement(node_id, *, incarnation=1, seq=0, mesh_id="m", **fields):
    return mesh.PeerAnnouncement(
        endpoint_id=node_id, incarnation=incarnation, heartbeat_seq=seq, mesh_id=mesh_id, **fields
    )


def record(node_id, **fields):
    """A record of ``node_id`` as its node signed it (what the peer table merges)."""
    signed = sign_record(IDENTITIES[node_id], announcement(node_id, **fields))
    return VerifiedRecord(mesh.PeerAnnouncement.FromString(signed.record), signed)


def entry(node_id, **fields):
    return mesh.GossipEntry(record=sign_record(IDENTITIES[node_id], announcement(node_id, **fields)))


# -- rules ---------------------------------------------------------------------------------------


def test_only_gossip_and_route_requests_pass_before_admission():
    allowed = {t for t in StreamType if stream_allowed_before_admission(t)}
    assert allowed == {StreamType.GOSSIP, StreamType.ROUTE_REQUEST}


def test_peer_down_never_removes_directly_and_never_about_self_or_reporter():
    assert resolve_peer_down(reported_id=C, reporter_id=B, self_id=A, known=True) is PeerDownAction.PROBE
    assert (
        resolve_peer_down(reported_id=C, reporter_id=B, self_id=A, known=False)
        is PeerDownAction.IGNORE_UNKNOWN
    )
    assert (
        resolve_peer_down(reported_id=A, reporter_id=B, self_id=A, known=True)
        is PeerDownAction.REJECT_SELF_REPORT
    )
    assert (
        resolve_peer_down(reported_id=B, reporter_id=B, self_id=A, known=True)
        is PeerDownAction.REJECT_SELF_REPORT
    )


def test_peer_leaving_removes_only_the_authenticated_sender():
    assert resolve_peer_leaving(leaving_id=B, authenticated_peer_id=B) is PeerLeavingAction.REMOVE_SENDER
    assert resolve_peer_leaving(leaving_id=C, authenticated_peer_id=B) is PeerLeavingAction.REJECT_FORGED


def test_link_tie_break_is_the_same_on_both_ends():
    # Simultaneous dial between A (lower id) and B: both keep A's link, whatever arrived first.
    link_by_a = LinkCandidate(dialer_id=A, established_at=10.0)
    link_by_b = LinkCandidate(dialer_id=B, established_at=10.1)
    assert keep_new_link(link_by_b, link_by_a, race_window=2.0)  # at A or B: A's link arrives second
    assert not keep_new_link(link_by_a, link_by_b, race_window=2.0)  # A's link arrived first
    # Outside the race window the newer link wins: the peer reconnected.
    later = LinkCandidate(dialer_id=B, established_at=30.0)
    assert keep_new_link(link_by_a, later, race_window=2.0)
    same_dialer = LinkCandidate(dialer_id=A, established_at=10.5)
    assert keep_new_link(link_by_a, same_dialer, race_window=2.0)


@pytest.mark.parametrize(
    ("incoming", "current", "tombstone", "direct", "expected"),
    [
        (Freshness(1, 5), None, None, False, MergeAction.ADD),
        (Freshness(1, 5), Freshness(1, 4), None, False, MergeAction.UPDATE),
        (Freshness(1, 4), Freshness(1, 4), None, False, MergeAction.IGNORE_STALE),
        (Freshness(1, 9), Freshness(2, 0), None, True, MergeAction.IGNORE_STALE),
        # Stale gossip relayed by others cannot resurrect a departed peer...
        (Freshness(1, 4), None, Freshness(1, 4), False, MergeAction.IGNORE_TOMBSTONED),
        (Freshness(1, 9), None, Freshness(1, 4), False, MergeAction.IGNORE_TOMBSTONED),
        # ...a restarted node (new incarnation) comes back, even via others...
        (Freshness(2, 0), None, Freshness(1, 4), False, MergeAction.ADD),
        # ...and so does a node that talks to us itself with fresher state.
        (Freshness(1, 9), None, Freshness(1, 4), True, MergeAction.ADD),
        (Freshness(1, 4), None, Freshness(1, 4), True, MergeAction.IGNORE_TOMBSTONED),
    ],
)
def test_resolve_announcement(incoming, current, tombstone, direct, expected):
    action = resolve_announcement(
        incoming=incoming, current=current, tombstone=tombstone, is_self=False, direct=direct
    )
    assert action is expected


def test_own_announcement_is_never_merged():
    action = resolve_announcement(
        incoming=Freshness(9, 9), current=None, tombstone=None, is_self=True, direct=True
    )
    assert action is MergeAction.IGNORE_SELF


# -- validators ----------------------------------------------------------------------------------


def gossip(sender=B, gen=1, entries=None):
    return mesh.GossipFrame(gen=gen, sender_id=sender, entries=entries if entries is not None else [entry(B)])


def opened(frame, sender=B):
    return open_gossip_entries(frame.entries, sender=sender, mesh_id="m", unix_now=NOW, held=lambda _: None)


def test_gossip_validation_follows_the_seed_order():
    validate_gossip_frame(gossip(), B)
    assert code_of(lambda: validate_gossip_frame(gossip(gen=2), B)) == mesh.MESH_ERROR_BAD_GENERATION
    assert (
        code_of(lambda: validate_gossip_frame(gossip(gen=0, sender=b"x"), B))
        == mesh.MESH_ERROR_BAD_GENERATION
    )
    assert code_of(lambda: validate_gossip_frame(gossip(sender=b"short"), B)) == mesh.MESH_ERROR_MALFORMED
    assert code_of(lambda: validate_gossip_frame(gossip(sender=C), B)) == mesh.MESH_ERROR_SENDER_MISMATCH
    many = [entry(B)] + [mesh.GossipEntry() for _ in range(MAX_PEERS_PER_FRAME)]
    assert code_of(lambda: validate_gossip_frame(gossip(entries=many), B)) == mesh.MESH_ERROR_MALFORMED


def test_gossip_records_need_the_senders_own_once_each():
    assert opened(gossip()).sender_record().node_id == B
    # A record whose endpoint_id is no node id is dropped; the frame stands on the sender's own.
    bad_id = mesh.GossipEntry(
        record=mesh.SignedPeerRecord(
            record=mesh.PeerAnnouncement(endpoint_id=b"\x01" * 31).SerializeToString(), signature=b"s" * 64
        )
    )
    result = opened(gossip(entries=[entry(B), bad_id]))
    assert [(d.fault, d.node_id) for d in result.dropped] == [(RecordFault.MALFORMED, None)]
    assert code_of(lambda: opened(gossip(entries=[entry(C)])).sender_record()) == mesh.MESH_ERROR_MALFORMED
    twice = [entry(B), entry(B, seq=1)]
    assert code_of(lambda: opened(gossip(entries=twice))) == mesh.MESH_ERROR_MALFORMED


@pytest.mark.parametrize(
    "fields",
    [
        {"role": mesh.NODE_ROLE_HOST},  # HOST needs http_port
        {"addresses": ["no-port"]},
        {"addresses": ["h:1"] * 9},
        {"relays": [mesh.RelayEndpoint(relay_id=b"r", address="h:1")]},
        {"hostname": "x" * 300},
        {
            "serving": mesh.ServedShard(
                model_name="m", total_layers=10, shard_range={"start_layer": 4, "end_layer": 12}
            )
        },
        {"serving": mesh.ServedShard(model_name="m", shard_range={"start_layer": 4, "end_layer": 4})},
        {
            "serving": mesh.ServedShard(
                model_name="m", numerics="x" * 300, shard_range={"start_layer": 0, "end_layer": 4}
            )
        },
    ],
)
def test_bad_announcements_are_malformed(fields):
    # The sender's own: the frame is refused...
    own = opened(gossip(entries=[entry(B, **fields)]))
    assert code_of(own.sender_record) == mesh.MESH_ERROR_MALFORMED
    # ...another node's, even signed by it, is dropped.
    other = opened(gossip(entries=[entry(B), entry(C, **fields)]))
    assert [r.node_id for r in other.records] == [B]
    assert [(d.fault, d.node_id) for d in other.dropped] == [(RecordFault.MALFORMED, C)]


def test_small_message_validators():
    validate_route_request(mesh.RouteTableRequest(gen=1), B)
    validate_route_request(mesh.RouteTableRequest(gen=1, requester_id=B), B)
    assert (
        code_of(lambda: validate_route_request(mesh.RouteTableRequest(gen=3), B))
        == mesh.MESH_ERROR_BAD_GENERATION
    )
    assert (
        code_of(lambda: validate_route_request(mesh.RouteTableRequest(gen=1, requester_id=C), B))
        == mesh.MESH_ERROR_SENDER_MISMATCH
    )
    assert (
        code_of(lambda: validate_peer_down(mesh.PeerDown(gen=1, peer_id=b"x"))) == mesh.MESH_ERROR_MALFORMED
    )
    assert (
        code_of(lambda: validate_peer_down(mesh.PeerDown(gen=0, peer_id=C))) == mesh.MESH_ERROR_BAD_GENERATION
    )
    assert (
        code_of(lambda: validate_peer_leaving(mesh.PeerLeaving(gen=2, peer_id=C)))
        == mesh.MESH_ERROR_BAD_GENERATION
    )
    assert code_of(lambda: validate_probe(mesh.Probe(gen=1, nonce=b"n" * 33))) == mesh.MESH_ERROR_MALFORMED
    # An indirect probe names a whole node id.
    assert code_of(lambda: validate_probe(mesh.Probe(gen=1, target=C[:31]))) == mesh.MESH_ERROR_MALFORMED
    validate_probe(mesh.Probe(gen=1, nonce=b"n", target=C))
    assert code_of(lambda: decode(mesh.GossipFrame, b"\xff\xff\xff")) == mesh.MESH_ERROR_MALFORMED


def test_refusals_round_trip_through_reset_codes():
    refusal = MeshRefusal(mesh.MESH_ERROR_NOT_ADMITTED)
    back = refusal_from_reset_code(reset_code(mesh.MESH_ERROR_NOT_ADMITTED))
    assert isinstance(back, RemoteRefusal) and back.code == refusal.code
    assert refusal_from_reset_code(0) is None and refusal_from_reset_code(0x100) is None
    assert refusal_from_reset_code(0x100 + 999) is None
    assert "not admitted" in str(refusal)


# -- peer table ----------------------------------------------------------------------------------


def test_peer_table_tombstones_stop_stale_gossip_until_they_expire():
    table = PeerTable(A, tombstone_ttl_ns=60 * SECOND_NS)
    report = table.merge([record(A), record(B, seq=3), record(C)], from_peer=B, now_ns=0)
    assert report.added == [B, C] and A not in table
    assert table.get(B).last_direct_ns == 0 and table.get(C).last_direct_ns is None
    table.merge([record(B, seq=4)], from_peer=C, now_ns=5 * SECOND_NS)
    assert table.get(B).last_heard_ns == 5 * SECOND_NS
    table.merge([record(B, seq=4)], from_peer=C, now_ns=9 * SECOND_NS)
    assert table.get(B).last_heard_ns == 5 * SECOND_NS  # not fresher: B is not heard from by repetition
    assert table.stale(now_ns=20 * SECOND_NS, timeout_ns=10 * SECOND_NS) == [B, C]
    assert table.remove(B, reason="left", now_ns=10 * SECOND_NS)
    assert not table.remove(B, reason="left", now_ns=10 * SECOND_NS)
    assert table.merge([record(B, seq=4)], from_peer=C, now_ns=11 * SECOND_NS).ignored_tombstoned == [B]
    assert B not in table
    # The restarted B (new incarnation) is accepted while the tombstone lives.
    assert table.merge([record(B, incarnation=2)], from_peer=C, now_ns=12 * SECOND_NS).added == [B]
    table.remove(B, reason="down", now_ns=20 * SECOND_NS)
    assert table.tombstone_count == 1
    assert table.merge([record(B, incarnation=2)], from_peer=C, now_ns=81 * SECOND_NS).added == [B]
    assert table.tombstone_count == 0


def test_peer_table_is_bounded():
    table = PeerTable(A, tombstone_ttl_ns=SECOND_NS, max_peers=2)
    report = table.merge([record(node_id) for node_id in MORE[:5]], from_peer=B, now_ns=0)
    assert len(table) == 2 and len(report.ignored_full) == 3


def test_a_new_member_beyond_the_table_bound_is_refused_and_the_members_it_holds_are_not():
    mesh_key = MeshKey.generate()
    node, member, newcomer = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    state = member_state(mesh_key, node, max_peers=1)
    member_frame = member_state(mesh_key, member).gossip_frame(node.node_id)
    state.receive_gossip(member_frame, peer_id=member.node_id, now_ns=0, unix_now=NOW)
    frame = member_state(mesh_key, newcomer).gossip_frame(node.node_id)
    with pytest.raises(MeshRefusal) as refused:
        state.receive_gossip(frame, peer_id=newcomer.node_id, now_ns=0, unix_now=NOW)
    assert refused.value.code == mesh.MESH_ERROR_TABLE_FULL
    assert "1 members (--max-peers)" in refused.value.detail
    assert not state.is_admitted(newcomer.node_id) and newcomer.node_id not in state.table
    # The member it holds still gossips with it.
    state.receive_gossip(member_frame, peer_id=member.node_id, now_ns=1, unix_now=NOW)


# -- MeshState: admission, grants, merges ------------------------------------------------------------


def member_state(mesh_key, identity, **kwargs):
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=NOW
    )
    return MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1, addresses=["127.0.0.1:1"]),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
        **kwargs,
    )


def joiner_state(invite, identity):
    return MeshState(
        identity=identity,
        mesh_id=invite.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1, addresses=["127.0.0.1:2"]),
        membership=None,
        invite=invite,
    )


def test_invite_join_grants_membership_and_admits_both_ways():
    mesh_key = MeshKey.generate()
    first, joiner = NodeIdentity.generate(), NodeIdentity.generate()
    bootstrap = [Endpoint(first.node_id, "127.0.0.1:1")]
    invite = create_invite(mesh_key, issuer_id=first.node_id, bootstrap=bootstrap, unix_now=NOW)
    acceptor, dialer = member_state(mesh_key, first), joiner_state(invite, joiner)
    assert not dialer.is_member

    outcome = acceptor.receive_gossip(
        dialer.gossip_frame(first.node_id), peer_id=joiner.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    )
    assert outcome.newly_admitted and outcome.via_invite and acceptor.is_admitted(joiner.node_id)
    assert outcome.reply.HasField("membership_grant") and joiner.node_id in acceptor.table

    reply = dialer.receive_gossip_reply(
        outcome.reply, peer_id=first.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    )
    assert reply.joined and dialer.is_member and dialer.membership.mesh_id == mesh_key.mesh_id
    assert dialer.is_admitted(first.node_id) and first.node_id in dialer.table
    # From now on the joiner shows its certificate; a second exchange grants nothing new.
    assert dialer.gossip_frame(first.node_id).membership_proof.WhichOneof("credential") == "certificate"
    again = acceptor.receive_gossip(
        dialer.gossip_frame(first.node_id), peer_id=joiner.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    )
    assert not again.newly_admitted and not again.reply.HasField("membership_grant")


def test_gossip_refusals_carry_exact_codes():
    mesh_key = MeshKey.generate()
    node, stranger = NodeIdentity.generate(), NodeIdentity.generate()
    state = member_state(mesh_key, node)

    def frame(**changes):
        f = mesh.GossipFrame(gen=1, sender_id=stranger.node_id)
        own = announcement(stranger.node_id, mesh_id=mesh_key.mesh_id)
        f.entries.add().record.CopyFrom(sign_record(stranger, own))
        for name, value in changes.items():
            setattr(f, name, value)
        return f

    receive = partial(state.receive_gossip, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert code_of(lambda: receive(frame(), peer_id=stranger.node_id)) == mesh.MESH_ERROR_NO_CREDENTIAL
    assert code_of(lambda: receive(frame(gen=2), peer_id=stranger.node_id)) == mesh.MESH_ERROR_BAD_GENERATION
    assert code_of(lambda: receive(frame(), peer_id=node.node_id)) == mesh.MESH_ERROR_SENDER_MISMATCH
    assert not state.is_admitted(stranger.node_id) and stranger.node_id not in state.table
    # A member of another mesh, with a valid certificate of its own mesh.
    other_key = MeshKey.generate()
    outsider = member_state(other_key, stranger)
    outsider_frame = outsider.gossip_frame(node.node_id)
    assert code_of(lambda: receive(outsider_frame, peer_id=stranger.node_id)) == mesh.MESH_ERROR_OTHER_MESH


def test_a_refusal_reply_becomes_a_remote_refusal():
    mesh_key = MeshKey.generate()
    node, peer = NodeIdentity.generate(), NodeIdentity.generate()
    state, other = member_state(mesh_key, node), member_state(mesh_key, peer)
    reply = other.refusal_frame(MeshRefusal(mesh.MESH_ERROR_INVITE_EXPIRED))
    with pytest.raises(RemoteRefusal) as info:
        state.receive_gossip_reply(reply, peer_id=peer.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert info.value.code == mesh.MESH_ERROR_INVITE_EXPIRED and "expired" in info.value.detail


def test_removed_peer_must_prove_membership_again():
    mesh_key = MeshKey.generate()
    node, peer = NodeIdentity.generate(), NodeIdentity.generate()
    state, other = member_state(mesh_key, node), member_state(mesh_key, peer)
    state.receive_gossip(
        other.gossip_frame(node.node_id), peer_id=peer.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    )
    assert state.remove_peer(peer.node_id, reason="left", now_ns=MONOTONIC_NS)
    assert not state.is_admitted(peer.node_id)
    no_proof = other.gossip_frame(node.node_id)
    no_proof.ClearField("membership_proof")
    assert code_of(
        lambda: state.receive_gossip(no_proof, peer_id=peer.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    ) == (mesh.MESH_ERROR_NO_CREDENTIAL)


def test_route_table_lists_everyone_without_admitting_the_requester():
    mesh_key = MeshKey.generate()
    node, peer = NodeIdentity.generate(), NodeIdentity.generate()
    state = member_state(mesh_key, node)
    state.local.serving.CopyFrom(
        mesh.ServedShard(model_name="tiny", total_layers=8, shard_range={"start_layer": 0, "end_layer": 4})
    )
    state.receive_gossip(
        member_state(mesh_key, peer).gossip_frame(node.node_id),
        peer_id=peer.node_id,
        now_ns=MONOTONIC_NS,
        unix_now=NOW,
    )
    table = state.route_table()
    assert table.gen == 1 and table.mesh_id == mesh_key.mesh_id
    assert {e.endpoint_id for e in table.entries} == {node.node_id, peer.node_id}
    assert [e.model for e in table.entries if e.endpoint_id == node.node_id] == ["tiny"]


# -- MeshState: the heartbeat timer, on the monotonic clock ----------------------------------------

HEARTBEAT_NS = 5 * SECOND_NS
PEER_TIMEOUT_NS = 20 * SECOND_NS


def timed_member(mesh_key, identity):
    return member_state(
        mesh_key,
        identity,
        heartbeat_interval_ns=HEARTBEAT_NS,
        peer_timeout_ns=PEER_TIMEOUT_NS,
        tombstone_ttl_ns=60 * SECOND_NS,
    )


def test_the_heartbeat_timer_beats_once_per_interval_and_reports_quiet_peers_at_each_beat():
    mesh_key = MeshKey.generate()
    node, peer = NodeIdentity.generate(), NodeIdentity.generate()
    state, other = timed_member(mesh_key, node), member_state(mesh_key, peer)
    assert state.get_timer() is None
    state.start_heartbeat(0)
    assert state.get_timer() == HEARTBEAT_NS
    state.handle_timer(HEARTBEAT_NS - 1)  # early: nothing yet
    assert state.take_events() == [] and state.local.heartbeat_seq == 0

    frame = other.gossip_frame(node.node_id)
    state.receive_gossip(frame, peer_id=peer.node_id, now_ns=SECOND_NS, unix_now=NOW)
    state.handle_timer(HEARTBEAT_NS)
    assert state.take_events() == [HeartbeatDue()] and state.local.heartbeat_seq == 1
    assert state.get_timer() == 2 * HEARTBEAT_NS
    state.handle_timer(SECOND_NS + PEER_TIMEOUT_NS)  # quiet for exactly the timeout: not yet stale
    assert state.take_events() == [HeartbeatDue()]
    # Late by seconds: one beat, not one per missed interval, and the next one interval later.
    late_ns = 30 * SECOND_NS
    state.handle_timer(late_ns)
    assert state.take_events() == [HeartbeatDue(), PeerStale(peer.node_id)]
    assert state.get_timer() == late_ns + HEARTBEAT_NS and state.local.heartbeat_seq == 3
    state.handle_timer(late_ns + HEARTBEAT_NS)  # still quiet: reported again, and never dropped here
    assert state.take_events() == [HeartbeatDue(), PeerStale(peer.node_id)]
    assert peer.node_id in state.table
    other.heartbeat()
    frame = other.gossip_frame(node.node_id)
    state.receive_gossip(frame, peer_id=peer.node_id, now_ns=late_ns + HEARTBEAT_NS, unix_now=NOW)
    state.handle_timer(late_ns + 2 * HEARTBEAT_NS)
    assert state.take_events() == [HeartbeatDue()]


def test_without_record_heartbeats_a_record_gets_fresher_only_when_its_content_changes():
    """Delta gossip's liveness is SWIM's: a quiet record stays one version, so a digest finds
    nothing to send for it, and no peer is ever reported stale."""
    mesh_key = MeshKey.generate()
    node, peer = NodeIdentity.generate(), NodeIdentity.generate()
    state = member_state(
        mesh_key,
        node,
        heartbeat_interval_ns=HEARTBEAT_NS,
        peer_timeout_ns=PEER_TIMEOUT_NS,
        record_heartbeats=False,
    )
    other = member_state(mesh_key, peer)
    state.receive_gossip(other.gossip_frame(node.node_id), peer_id=peer.node_id, now_ns=0, unix_now=NOW)
    state.start_heartbeat(0)
    published = state.local_record()
    for beat in range(1, 8):  # well past the peer timeout
        state.handle_timer(beat * HEARTBEAT_NS)
        assert state.take_events() == [HeartbeatDue()]
    assert state.local.heartbeat_seq == 0 and state.local_record() == published
    # A change between beats: the record signed after it is one version fresher, never the same
    # version with other content, and the next beats leave it there.
    state.local.load.active_sessions = 3
    assert state.local_version() == (state.local.incarnation, 1)
    assert mesh.PeerAnnouncement.FromString(state.local_record().record).heartbeat_seq == 1
    state.handle_timer(8 * HEARTBEAT_NS)
    state.local.load.active_sessions = 4
    state.handle_timer(9 * HEARTBEAT_NS)
    state.handle_timer(10 * HEARTBEAT_NS)
    assert state.local.heartbeat_seq == 2


def test_without_frame_revocations_a_gossip_frame_carries_only_the_one_naming_its_receiver():
    """Delta gossip exchanges revocations by digest; a first contact still shows a removed node
    the signed revocation that names it."""
    mesh_key = MeshKey.generate()
    node, removed, other = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    state = member_state(mesh_key, node, frame_revocations=False)
    revocations = [
        revoke_node(mesh_key, node_id=removed.node_id, reason="gone", issuer_id=node.node_id, unix_now=NOW),
        revoke_invite(mesh_key, invite_id=b"i" * 32, reason="leaked", issuer_id=node.node_id, unix_now=NOW),
    ]
    assert len(state.learn_revocations(revocations, now_ns=0).new) == 2
    assert list(state.gossip_frame(other.node_id).revocations) == []
    assert list(state.gossip_frame(removed.node_id).revocations) == [revocations[0]]
    # Today's frames carry them all.
    everything = member_state(mesh_key, node)
    everything.learn_revocations(revocations, now_ns=0)
    assert len(everything.gossip_frame(other.node_id).revocations) == 2


def test_a_wall_clock_step_makes_no_peer_stale_and_ends_no_tombstone_while_invites_expire_by_it():
    """Issue 18: liveness ran on the wall clock, so a step forward made every peer stale (and one
    back kept a dead peer fresh for as long). The wall clock here jumps an hour ahead between a
    peer's gossip and the next beat, and back an hour later: liveness follows only the monotonic
    clock, while an invite's validity still follows the wall clock."""
    mesh_key = MeshKey.generate()
    node, peer, gone, newcomer = (NodeIdentity.generate() for _ in range(4))
    state = timed_member(mesh_key, node)
    other, departed = member_state(mesh_key, peer), member_state(mesh_key, gone)
    bootstrap = [Endpoint(node.node_id, "127.0.0.1:1")]
    invite = create_invite(mesh_key, issuer_id=node.node_id, bootstrap=bootstrap, ttl_s=1800, unix_now=NOW)
    joiner = joiner_state(invite, newcomer)

    def clocks(seconds):
        """(now_ns, unix_now) ``seconds`` into the run: the wall clock is an hour ahead from 12 s to 27 s."""
        return seconds * SECOND_NS, NOW + seconds + (3600 if 12 <= seconds < 27 else 0)

    def gossip_from_peer(seconds):
        other.heartbeat()
        now_ns, unix_now = clocks(seconds)
        frame = other.gossip_frame(node.node_id)
        return state.receive_gossip(frame, peer_id=peer.node_id, now_ns=now_ns, unix_now=unix_now).merged

    def join(seconds):
        now_ns, unix_now = clocks(seconds)
        frame = joiner.gossip_frame(node.node_id)
        return state.receive_gossip(frame, peer_id=newcomer.node_id, now_ns=now_ns, unix_now=unix_now)

    # A node that left: this node tombstones it, while the peer still relays its last record.
    state.receive_gossip(departed.gossip_frame(node.node_id), peer_id=gone.node_id, now_ns=0, unix_now=NOW)
    other.receive_gossip(departed.gossip_frame(peer.node_id), peer_id=gone.node_id, now_ns=0, unix_now=NOW)
    assert state.remove_peer(gone.node_id, reason="left", now_ns=0)
    assert gossip_from_peer(0).added == [peer.node_id]
    state.start_heartbeat(0)

    for seconds in range(1, 31):
        if seconds % 5 == 1:  # the peer gossips a second after each beat
            merged = gossip_from_peer(seconds)
            assert merged.updated == [peer.node_id] and merged.ignored_tombstoned == [gone.node_id]
        if seconds % 5 == 0:
            state.handle_timer(clocks(seconds)[0])
            assert state.take_events() == [HeartbeatDue()]
        if seconds == 20:  # an hour ahead, the invite (valid for 30 minutes) has expired
            assert code_of(lambda: join(20)) == mesh.MESH_ERROR_INVITE_EXPIRED
    assert peer.node_id in state.table and state.table.tombstone(gone.node_id) is not None
    assert join(31).via_invite  # the clock back, the same invite is valid again

    # The peer stops: stale once quiet for longer than the timeout (last heard at 26 s), not an hour.
    for seconds in (35, 40, 45):
        state.handle_timer(clocks(seconds)[0])
        assert state.take_events() == [HeartbeatDue()]
    state.handle_timer(clocks(50)[0])
    assert state.take_events() == [HeartbeatDue(), PeerStale(peer.node_id)]
    # The tombstone ends its 60 s after the node left, by the same clock.
    state.handle_timer(clocks(55)[0])
    assert state.table.tombstone(gone.node_id) is not None
    state.handle_timer(clocks(60)[0])
    assert state.table.tombstone(gone.node_id) is None


def test_refusal_logging_is_rate_limited(caplog):
    import logging

    from meshnode.mesh.ratelog import RateLimitedLog

    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.ratelog"), burst=3, window_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.ratelog"):
        for i in range(100):
            limited.log(logging.INFO, "refused %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "refused 2"]
        now[0] = 11.0
        limited.log(logging.INFO, "refused %d", 100)
    assert [r.getMessage() for r in caplog.records][3:] == [
        "... and 97 more like it (not logged)",
        "refused 100",
    ]
