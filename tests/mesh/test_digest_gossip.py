"""Delta gossip between two members: digests first, then only the records that differ.

Each exchange is the four frames of meshnode.mesh.digest_gossip, serialized and decoded
as the edge would; the records stay signed by their subjects and are verified on receipt.
"""

import time

import pytest
from google.protobuf.message import Message

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.revocation import revoke_node
from meshnode.membership.store import MembershipState
from meshnode.mesh.digest_gossip import DigestGossip, bucket_count_for, tag_of
from meshnode.mesh.signed_record import VerifiedRecord, decode_record, sign_record
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import (
    MAX_DIGEST_BUCKETS,
    MAX_DIGEST_ENTRIES_PER_FRAME,
    MAX_PEERS_PER_FRAME,
    MAX_WANTED_PER_FRAME,
    decode,
)
from meshnode.sansio import SECOND_NS
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NOW = time.time()
NOW_NS = 100 * SECOND_NS


def code_of(call):
    with pytest.raises(MeshRefusal) as info:
        call()
    return info.value.code


class Member:
    def __init__(self, mesh_key: MeshKey) -> None:
        self.identity = NodeIdentity.generate()
        certificate = issue_certificate(
            mesh_key, node_id=self.identity.node_id, issuer_id=self.identity.node_id, unix_now=NOW
        )
        self.state = MeshState(
            identity=self.identity,
            mesh_id=mesh_key.mesh_id,
            local=mesh.PeerAnnouncement(incarnation=int(NOW * SECOND_NS), addresses=["127.0.0.1:1"]),
            membership=MembershipState(mesh_key=None, certificate=certificate),
            frame_table_limit=0,
        )
        self.digest = DigestGossip(self.state)

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id


def wire(message: Message) -> bytes:
    return message.SerializeToString()


def admit(a: Member, b: Member) -> None:
    """The first exchange on a link (a GossipFrame each way), which admits both."""
    outcome = b.state.receive_gossip(
        decode(mesh.GossipFrame, wire(a.state.gossip_frame(b.node_id))),
        peer_id=a.node_id,
        now_ns=NOW_NS,
        unix_now=NOW,
    )
    a.state.receive_gossip_reply(
        decode(mesh.GossipFrame, wire(outcome.reply)), peer_id=b.node_id, now_ns=NOW_NS, unix_now=NOW
    )


def exchange(opener: Member, responder: Member) -> list[int]:
    """One delta exchange; the sizes of its four frames."""
    sent = opener.digest.open()
    reply = responder.digest.answer_open(decode(mesh.DigestOpen, wire(sent)), peer_id=opener.node_id)
    push = opener.digest.answer_reply(sent, decode(mesh.DigestReply, wire(reply)), peer_id=responder.node_id)
    records, _ = responder.digest.answer_push(
        decode(mesh.DigestPush, wire(push)), peer_id=opener.node_id, now_ns=NOW_NS, unix_now=NOW
    )
    opener.digest.take_records(
        decode(mesh.DigestRecords, wire(records)), peer_id=responder.node_id, now_ns=NOW_NS, unix_now=NOW
    )
    return [len(wire(m)) for m in (sent, reply, push, records)]


def outsiders(member: Member, count: int, *, mesh_id: str) -> list[NodeIdentity]:
    """``count`` other nodes whose own signed records ``member`` holds."""
    identities = [NodeIdentity.generate() for _ in range(count)]
    records = []
    for identity in identities:
        signed = sign_record(
            identity, mesh.PeerAnnouncement(endpoint_id=identity.node_id, incarnation=1, mesh_id=mesh_id)
        )
        records.append(VerifiedRecord(decode_record(signed), signed))
    member.state.table.merge(records, from_peer=records[0].node_id, now_ns=NOW_NS)
    return identities


@pytest.fixture
def mesh_key():
    return MeshKey.generate()


@pytest.fixture
def pair(mesh_key):
    a, b = Member(mesh_key), Member(mesh_key)
    admit(a, b)
    return a, b


def held_ids(member: Member) -> set[bytes]:
    return set(member.digest.versions())


def test_one_exchange_gives_each_side_what_the_other_held(pair, mesh_key):
    a, b = pair
    only_a = outsiders(a, 20, mesh_id=mesh_key.mesh_id)
    only_b = outsiders(b, 30, mesh_id=mesh_key.mesh_id)
    exchange(a, b)
    both = {a.node_id, b.node_id} | {i.node_id for i in only_a + only_b}
    assert held_ids(a) == held_ids(b) == both


def test_in_sync_members_send_only_summaries(pair, mesh_key):
    a, b = pair
    outsiders(a, 200, mesh_id=mesh_key.mesh_id)
    exchange(a, b)
    sizes = exchange(a, b)
    # Nothing listed, pushed or asked for: the open's summary (32 buckets of 2 bytes), then headers.
    empty = [
        mesh.DigestReply(gen=1, sender_id=b.node_id),
        mesh.DigestPush(gen=1, sender_id=a.node_id),
        mesh.DigestRecords(gen=1, sender_id=b.node_id),
    ]
    assert sizes[1:] == [len(wire(m)) for m in empty]
    assert sizes[0] < 150


def test_a_newer_version_replaces_the_older_one_on_the_other_side(pair):
    a, b = pair
    exchange(a, b)
    a.state.local.load.active_sessions = 7
    a.state.heartbeat()
    exchange(b, a)  # b opens: a's reply lists its newer version, b asks for it
    assert b.state.table.announcement_of(a.node_id).load.active_sessions == 7


def test_a_new_incarnation_reaches_a_member_holding_the_old_one_whichever_side_opens(pair, mesh_key):
    """A digest says an incarnation by a tag: another tag is another incarnation, whose record
    the two send each other, and each keeps the newer (the merge's rule)."""
    a, b = pair
    restarted = NodeIdentity.generate()

    def hold(member: Member, incarnation: int) -> None:
        announcement = mesh.PeerAnnouncement(
            endpoint_id=restarted.node_id, incarnation=incarnation, mesh_id=mesh_key.mesh_id
        )
        signed = sign_record(restarted, announcement)
        member.state.table.merge(
            [VerifiedRecord(decode_record(signed), signed)], from_peer=a.node_id, now_ns=0
        )

    hold(a, 1)
    hold(b, 2)
    exchange(a, b)
    assert a.state.table.announcement_of(restarted.node_id).incarnation == 2
    assert b.state.table.announcement_of(restarted.node_id).incarnation == 2
    c = Member(mesh_key)
    admit(c, b)
    hold(c, 1)
    exchange(b, c)  # now the one holding the newer opens
    assert c.state.table.announcement_of(restarted.node_id).incarnation == 2


def test_tags_that_collide_under_one_salt_differ_under_another():
    # Under salt 1 a tag is the value's top 16 bits: 1 and 2 tag alike; a salt drawn at random
    # tells them apart (a difference missed in one exchange is seen in the next).
    assert tag_of(1, 1) == tag_of(2, 1)
    assert tag_of(1, 0x9E3779B97F4A7C15) != tag_of(2, 0x9E3779B97F4A7C15)
    assert 0 <= tag_of(-5, 12345) < 2**16


def test_a_large_difference_goes_over_several_exchanges_each_frame_within_its_limits(pair, mesh_key):
    a, b = pair
    outsiders(b, 1000, mesh_id=mesh_key.mesh_id)
    exchanges = 0
    while held_ids(a) != held_ids(b):
        sent = a.digest.open()
        reply = b.digest.answer_open(sent, peer_id=a.node_id)
        assert len(reply.sequences) <= MAX_DIGEST_ENTRIES_PER_FRAME
        push = a.digest.answer_reply(sent, reply, peer_id=b.node_id)
        assert len(push.wanted) <= 4 * MAX_WANTED_PER_FRAME
        records, _ = b.digest.answer_push(push, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW)
        assert len(records.entries) <= MAX_PEERS_PER_FRAME
        a.digest.take_records(records, peer_id=b.node_id, now_ns=NOW_NS, unix_now=NOW)
        exchanges += 1
        assert exchanges <= 12
    assert len(held_ids(a)) == 1002


def test_a_forged_record_is_dropped_and_not_merged(pair, mesh_key):
    a, b = pair
    victim = outsiders(a, 1, mesh_id=mesh_key.mesh_id)[0]
    exchange(a, b)
    forged = mesh.PeerAnnouncement(
        endpoint_id=victim.node_id,
        incarnation=1,
        heartbeat_seq=9,
        mesh_id=mesh_key.mesh_id,
        addresses=["6.6.6.6:1"],
    )
    record = forged.SerializeToString(deterministic=True)
    push = mesh.DigestPush(gen=1, sender_id=a.node_id)
    # Signed by a, not by the node it names.
    push.entries.add().record.CopyFrom(
        mesh.SignedPeerRecord(record=record, signature=a.identity.sign(b"meshnode/v1/peer-record\0" + record))
    )
    b.digest.answer_push(push, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW)
    assert b.state.record_drops["bad_signature"] == 1
    assert list(b.state.table.announcement_of(victim.node_id).addresses) == []


def test_revocations_spread_by_digest_and_the_revoked_record_goes(pair, mesh_key):
    a, b = pair
    victim = Member(mesh_key)
    admit(victim, a)
    admit(victim, b)
    revocation = revoke_node(
        mesh_key, node_id=victim.node_id, reason="test", issuer_id=a.node_id, unix_now=NOW
    )
    a.state.learn_revocations([revocation], now_ns=NOW_NS)
    exchange(b, a)  # b opens; a's reply lists its revocation ids; b asks for the one it lacks
    assert b.state.revocations.node(victim.node_id) is not None
    assert victim.node_id not in b.state.table
    # And a record of the removed node is not merged again, from anyone.
    push = mesh.DigestPush(gen=1, sender_id=a.node_id)
    push.entries.add().record.CopyFrom(victim.state.local_record())
    b.digest.answer_push(push, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW)
    assert victim.node_id not in b.state.table
    assert b.state.record_drops["revoked"] == 1
    # The removed node itself is refused, and told why.
    assert (
        code_of(lambda: b.digest.answer_open(victim.digest.open(), peer_id=victim.node_id))
        == mesh.MESH_ERROR_REVOKED
    )


def test_a_forged_revocation_is_refused(pair):
    a, b = pair
    other_key = MeshKey.generate()  # not this mesh's admin key
    forged = revoke_node(other_key, node_id=a.node_id, reason="forged", issuer_id=b.node_id, unix_now=NOW)
    push = mesh.DigestPush(gen=1, sender_id=a.node_id)
    push.revocations.append(forged)
    _, report = b.digest.answer_push(push, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW)
    assert report.revocations_learned == 0
    assert b.state.revocations.node(a.node_id) is None


def test_a_peer_not_admitted_is_refused(mesh_key):
    a, stranger = Member(mesh_key), Member(mesh_key)
    assert code_of(lambda: a.digest.answer_open(stranger.digest.open(), peer_id=stranger.node_id)) == (
        mesh.MESH_ERROR_NOT_ADMITTED
    )


def test_malformed_digest_frames_are_refused_with_their_codes(pair):
    a, b = pair
    sent = a.digest.open()
    bad_count = mesh.DigestOpen(gen=1, sender_id=a.node_id, bucket_count=3, bucket_tags=bytes(6))
    assert code_of(lambda: b.digest.answer_open(bad_count, peer_id=a.node_id)) == mesh.MESH_ERROR_MALFORMED
    too_many = mesh.DigestOpen(
        gen=1,
        sender_id=a.node_id,
        bucket_count=2 * MAX_DIGEST_BUCKETS,
        bucket_tags=bytes(4 * MAX_DIGEST_BUCKETS),
    )
    assert code_of(lambda: b.digest.answer_open(too_many, peer_id=a.node_id)) == mesh.MESH_ERROR_MALFORMED
    short = mesh.DigestOpen(gen=1, sender_id=a.node_id, bucket_count=4, bucket_tags=bytes(2))
    assert code_of(lambda: b.digest.answer_open(short, peer_id=a.node_id)) == mesh.MESH_ERROR_MALFORMED
    assert code_of(lambda: b.digest.answer_open(sent, peer_id=b.node_id)) == mesh.MESH_ERROR_SENDER_MISMATCH
    old = mesh.DigestOpen(gen=2, sender_id=a.node_id, bucket_count=1, bucket_tags=bytes(2))
    assert code_of(lambda: b.digest.answer_open(old, peer_id=a.node_id)) == mesh.MESH_ERROR_BAD_GENERATION
    greedy = mesh.DigestPush(gen=1, sender_id=a.node_id, wanted=bytes(4 * (MAX_WANTED_PER_FRAME + 1)))
    assert (
        code_of(lambda: b.digest.answer_push(greedy, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW))
        == mesh.MESH_ERROR_MALFORMED
    )
    stray = mesh.DigestReply(gen=1, sender_id=b.node_id, listed_buckets=[sent.bucket_count])
    assert code_of(lambda: a.digest.answer_reply(sent, stray, peer_id=b.node_id)) == mesh.MESH_ERROR_MALFORMED
    uneven = mesh.DigestReply(
        gen=1, sender_id=b.node_id, node_prefixes=bytes(8), incarnation_tags=bytes(2), sequences=[1, 2]
    )
    assert (
        code_of(lambda: a.digest.answer_reply(sent, uneven, peer_id=b.node_id)) == mesh.MESH_ERROR_MALFORMED
    )
    # Prefixes are 4 bytes each, and so are the wanted ones.
    ragged = mesh.DigestReply(
        gen=1, sender_id=b.node_id, node_prefixes=bytes(5), incarnation_tags=bytes(2), sequences=[1]
    )
    assert (
        code_of(lambda: a.digest.answer_reply(sent, ragged, peer_id=b.node_id)) == mesh.MESH_ERROR_MALFORMED
    )
    torn = mesh.DigestPush(gen=1, sender_id=a.node_id, wanted=bytes(6))
    assert (
        code_of(lambda: b.digest.answer_push(torn, peer_id=a.node_id, now_ns=NOW_NS, unix_now=NOW))
        == mesh.MESH_ERROR_MALFORMED
    )
    crowded = mesh.DigestOpen(
        gen=1, sender_id=a.node_id, bucket_count=1, bucket_tags=bytes(2), suspected=[b.node_id] * 17
    )
    assert code_of(lambda: b.digest.answer_open(crowded, peer_id=a.node_id)) == mesh.MESH_ERROR_MALFORMED
    odd = mesh.DigestOpen(
        gen=1, sender_id=a.node_id, bucket_count=1, bucket_tags=bytes(2), suspected=[b"x" * 5]
    )
    assert code_of(lambda: b.digest.answer_open(odd, peer_id=a.node_id)) == mesh.MESH_ERROR_MALFORMED


def test_bucket_counts_are_powers_of_two_within_bounds():
    assert bucket_count_for(1) == 1
    assert bucket_count_for(300) == 64
    assert bucket_count_for(1024) == 128
    assert bucket_count_for(10**6) == MAX_DIGEST_BUCKETS


def test_a_member_wrongly_confirmed_down_is_admitted_again_once_it_refutes(pair):
    """SWIM's refutation under delta gossip: a's probes wrongly confirmed b down. b's record does
    not change by itself, so it cannot beat a's tombstone; a, hearing from b itself, tells it
    (the edge names it on its digest frames), b signs a fresher record, and that one does."""
    a, b = pair
    exchange(a, b)
    assert a.state.remove_peer(b.node_id, reason="confirmed down", now_ns=NOW_NS, refutable=True)
    assert a.state.removed_as_down(b.node_id)
    admit(b, a)  # b dials a again: a first contact admits it, but its record stays tombstoned
    exchange(b, a)
    assert b.node_id not in a.state.table
    assert a.state.removed_as_down(b.node_id)
    b.state.heartbeat()  # b heard itself named: what SwimLiveness.heard does
    exchange(b, a)  # b opens: a lacks b's record, b pushes it, a merges it (from b itself)
    assert b.node_id in a.state.table
    assert not a.state.removed_as_down(b.node_id)
    assert a.state.table.tombstone(b.node_id) is None


def test_the_fresher_record_is_asked_for_when_the_remover_opens(pair):
    a, b = pair
    exchange(a, b)
    a.state.remove_peer(b.node_id, reason="confirmed down", now_ns=NOW_NS, refutable=True)
    admit(b, a)
    b.state.heartbeat()
    exchange(a, b)  # a opens: b lists its fresher version, which a asks for (b is the sender)
    assert b.node_id in a.state.table


def test_a_departure_or_a_revocation_is_not_refutable(pair, mesh_key):
    a, b = pair
    victim = Member(mesh_key)
    admit(victim, a)
    exchange(a, b)
    assert a.state.remove_peer(b.node_id, reason="left the mesh", now_ns=NOW_NS)
    assert not a.state.removed_as_down(b.node_id)
    # Confirmed down first, revoked by an admin after: a revocation is never refuted.
    assert a.state.remove_peer(victim.node_id, reason="confirmed down", now_ns=NOW_NS, refutable=True)
    revocation = revoke_node(
        mesh_key, node_id=victim.node_id, reason="test", issuer_id=a.node_id, unix_now=NOW
    )
    a.state.learn_revocations([revocation], now_ns=NOW_NS)
    assert not a.state.removed_as_down(victim.node_id)
    victim.state.heartbeat()
    push = mesh.DigestPush(gen=1, sender_id=victim.node_id)
    push.entries.add().record.CopyFrom(victim.state.local_record())
    assert (
        code_of(lambda: a.digest.answer_push(push, peer_id=victim.node_id, now_ns=NOW_NS, unix_now=NOW))
        == mesh.MESH_ERROR_REVOKED
    )
    assert victim.node_id not in a.state.table
