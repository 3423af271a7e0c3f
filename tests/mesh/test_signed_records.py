"""Signed peer records, pure: signing, verification, the merge rule, and a member's forgery."""

from dataclasses import dataclass

import pytest

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    CERTIFICATE_TAG,
    Endpoint,
    MeshKey,
    create_invite,
    issue_certificate,
)
from meshnode.membership.store import MembershipState
from meshnode.mesh import gossip_records
from meshnode.mesh.peer_table import PeerTable
from meshnode.mesh.signed_record import (
    MAX_INCARNATION_AHEAD_NS,
    RECORD_DOMAIN,
    LocalRecord,
    RecordFault,
    RecordRejected,
    open_record,
    sign_record,
)
from meshnode.mesh.state import MeshState
from meshnode.sansio import SECOND_NS
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NOW = 1_800_000_000.0
NOW_NS = 1_800_000_000 * 1_000_000_000
# An instant of the monotonic clock that liveness runs on (its origin is arbitrary).
MONOTONIC_NS = 42 * SECOND_NS
MESH = "mesh-1"
NODE = NodeIdentity.from_seed(b"\x11" * 32)
FORGER = NodeIdentity.from_seed(b"\x22" * 32)


def announcement(identity=NODE, *, incarnation=NOW_NS - 10**9, seq=0, **fields):
    fields.setdefault("mesh_id", MESH)
    fields.setdefault("addresses", ["10.0.0.1:7447"])
    return mesh.PeerAnnouncement(
        endpoint_id=identity.node_id, incarnation=incarnation, heartbeat_seq=seq, **fields
    )


def fault_of(signed, now=NOW):
    with pytest.raises(RecordRejected) as info:
        open_record(signed, mesh_id=MESH, unix_now=now)
    return info.value.fault


def test_a_signed_record_opens_to_the_exact_announcement_and_its_bytes():
    original = announcement(serving=mesh.ServedShard(model_name="m", shard_range={"end_layer": 3}))
    signed = sign_record(NODE, original)
    opened = open_record(signed, mesh_id=MESH, unix_now=NOW)
    assert opened.announcement == original and opened.node_id == NODE.node_id
    assert opened.signed.record == signed.record and opened.signed.signature == signed.signature
    with pytest.raises(ValueError):
        sign_record(FORGER, original)  # a node signs only its own record


def test_tampered_bytes_are_a_bad_signature_or_malformed():
    signed = sign_record(NODE, announcement())
    # The address moved to a closed port: still decodes, no longer what the node signed.
    tampered = mesh.SignedPeerRecord(
        record=signed.record.replace(b"10.0.0.1:7447", b"10.0.0.1:7448"), signature=signed.signature
    )
    assert mesh.PeerAnnouncement.FromString(tampered.record).addresses == ["10.0.0.1:7448"]
    assert fault_of(tampered) is RecordFault.BAD_SIGNATURE
    truncated = mesh.SignedPeerRecord(record=signed.record[:-3], signature=signed.signature)
    assert fault_of(truncated) is RecordFault.MALFORMED
    flipped = bytearray(signed.signature)
    flipped[5] ^= 1
    assert fault_of(mesh.SignedPeerRecord(record=signed.record, signature=bytes(flipped))) is (
        RecordFault.BAD_SIGNATURE
    )


def test_a_record_signed_by_another_key_is_refused():
    record = announcement().SerializeToString()
    forged = mesh.SignedPeerRecord(record=record, signature=FORGER.sign(RECORD_DOMAIN + record))
    assert fault_of(forged) is RecordFault.BAD_SIGNATURE


def test_an_unsigned_record_is_refused_and_names_its_node():
    unsigned = mesh.SignedPeerRecord(record=announcement().SerializeToString())
    with pytest.raises(RecordRejected) as info:
        open_record(unsigned, mesh_id=MESH, unix_now=NOW)
    assert info.value.fault is RecordFault.UNSIGNED and info.value.node_id == NODE.node_id
    assert fault_of(mesh.SignedPeerRecord()) is RecordFault.UNSIGNED


@pytest.mark.parametrize(
    "prefix",
    [b"", CERTIFICATE_TAG, b"meshnode/v1/relay-register\0", b"meshnode/v1/peer-record", RECORD_DOMAIN * 2],
)
def test_a_signature_from_another_domain_is_refused(prefix):
    record = announcement().SerializeToString()
    other = mesh.SignedPeerRecord(record=record, signature=NODE.sign(prefix + record))
    assert fault_of(other) is RecordFault.BAD_SIGNATURE


def test_an_incarnation_far_ahead_of_our_clock_is_refused():
    at_limit = sign_record(NODE, announcement(incarnation=NOW_NS + MAX_INCARNATION_AHEAD_NS))
    assert open_record(at_limit, mesh_id=MESH, unix_now=NOW).announcement.incarnation > NOW_NS
    past_limit = sign_record(NODE, announcement(incarnation=NOW_NS + MAX_INCARNATION_AHEAD_NS + 1))
    assert fault_of(past_limit) is RecordFault.FUTURE_INCARNATION
    # The issue's forgery raised the incarnation by 10^15 ns (11.6 days); even signed, it is refused.
    pinned = sign_record(NODE, announcement(incarnation=NOW_NS + 10**15))
    assert fault_of(pinned) is RecordFault.FUTURE_INCARNATION
    # ...until the receiver's clock catches up: the bound is relative, not a ban.
    assert open_record(pinned, mesh_id=MESH, unix_now=NOW + 10**6).announcement.incarnation == NOW_NS + 10**15


def test_a_record_of_another_mesh_is_refused():
    assert fault_of(sign_record(NODE, announcement(mesh_id="other"))) is RecordFault.OTHER_MESH


def test_the_local_record_is_signed_again_only_when_it_changes():
    local = LocalRecord(NODE)
    own = announcement()
    first = local.signed(own)
    assert local.signed(own) is first
    own.heartbeat_seq += 1
    second = local.signed(own)
    assert (
        second is not first
        and open_record(second, mesh_id=MESH, unix_now=NOW).announcement.heartbeat_seq == 1
    )


def verified(identity=NODE, **fields):
    return open_record(sign_record(identity, announcement(identity, **fields)), mesh_id=MESH, unix_now=NOW)


def test_a_replayed_older_record_loses_to_a_newer_one():
    table = PeerTable(FORGER.node_id, tombstone_ttl_ns=60 * SECOND_NS)
    old, new = verified(seq=3), verified(seq=4)
    assert table.merge([new], from_peer=FORGER.node_id, now_ns=1).updated == []
    report = table.merge([old], from_peer=FORGER.node_id, now_ns=2)
    assert report.updated == [] and report.added == []
    held = table.get(NODE.node_id)
    assert held.announcement.heartbeat_seq == 4 and held.record == new.signed and held.last_heard_ns == 1
    # A record of the node's previous incarnation loses too, however high its sequence.
    previous_life = verified(incarnation=NOW_NS - 10**12, seq=10**6)
    assert table.merge([previous_life], from_peer=FORGER.node_id, now_ns=3).updated == []
    assert table.get(NODE.node_id).record == new.signed
    newer_life = verified(incarnation=NOW_NS, seq=0)
    assert table.merge([newer_life], from_peer=FORGER.node_id, now_ns=4).updated == [NODE.node_id]


# -- a member forging another node's record (issue 23) ---------------------------------------------


def member(mesh_key, identity, address):
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=NOW
    )
    return MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=NOW_NS - 10**9, addresses=[address]),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
    )


@dataclass
class Trio:
    """A holds B's real record; M, an admitted member, is about to lie about B."""

    mesh_key: MeshKey
    a: MeshState
    b: MeshState
    m: MeshState
    m_identity: NodeIdentity


@pytest.fixture
def trio() -> Trio:
    mesh_key = MeshKey.generate()
    m_identity = NodeIdentity.generate()
    a = member(mesh_key, NodeIdentity.generate(), "127.0.0.1:1")
    b = member(mesh_key, NodeIdentity.generate(), "127.0.0.1:2")
    m = member(mesh_key, m_identity, "127.0.0.1:3")
    b.local.serving.CopyFrom(
        mesh.ServedShard(model_name="tiny", total_layers=6, shard_range={"start_layer": 3, "end_layer": 6})
    )
    a.receive_gossip(b.gossip_frame(a.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    a.receive_gossip(m.gossip_frame(a.node_id), peer_id=m.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    return Trio(mesh_key, a, b, m, m_identity)


def forgery_of(real: mesh.SignedPeerRecord) -> bytes:
    """The issue's forgery: incarnation raised by 10^15, address a closed port, no serving range."""
    forged = mesh.PeerAnnouncement.FromString(real.record)
    forged.incarnation += 10**15
    forged.ClearField("addresses")
    forged.addresses.append("127.0.0.1:9")
    forged.ClearField("serving")
    return forged.SerializeToString()


def test_a_members_forged_record_of_another_node_is_dropped_and_counted(trio):
    a, b, m = trio.a, trio.b, trio.m
    real = a.table.get(b.node_id).record
    forged = forgery_of(real)
    attempts = [
        ("bad_signature", mesh.SignedPeerRecord(record=forged, signature=real.signature)),
        (
            "bad_signature",
            mesh.SignedPeerRecord(record=forged, signature=trio.m_identity.sign(RECORD_DOMAIN + forged)),
        ),
        ("unsigned", mesh.SignedPeerRecord(record=forged)),
    ]
    for reason, signed in attempts:
        frame = m.gossip_frame(a.node_id)
        frame.entries.add().record.CopyFrom(signed)
        outcome = a.receive_gossip(frame, peer_id=m.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
        assert [(d.fault.value, d.node_id) for d in outcome.merged.dropped] == [(reason, b.node_id)]
        assert outcome.merged.updated == outcome.merged.added == []
    assert a.record_drops == {"bad_signature": 2, "unsigned": 1}
    held = a.table.get(b.node_id)
    assert held.record == real and held.announcement.serving.shard_range.end_layer == 6
    assert list(held.announcement.addresses) == ["127.0.0.1:2"]
    assert a.is_admitted(m.node_id)  # its own record was sound: the sender stays admitted
    # B's own next heartbeat still replaces what A holds: nothing was pinned.
    b.heartbeat()
    assert a.receive_gossip(
        b.gossip_frame(a.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    ).merged.updated == [b.node_id]


def test_records_verify_without_the_mesh_key_and_travel_byte_for_byte(trio):
    a, b = trio.a, trio.b
    bootstrap = [Endpoint(a.node_id, "127.0.0.1:1")]
    invite = create_invite(trio.mesh_key, issuer_id=a.node_id, bootstrap=bootstrap, unix_now=NOW)
    joiner = MeshState(
        identity=NodeIdentity.generate(),
        mesh_id=invite.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=NOW_NS, addresses=["127.0.0.1:5"]),
        membership=None,  # holds no mesh key, and verifies every record all the same
        invite=invite,
    )
    outcome = a.receive_gossip(
        joiner.gossip_frame(a.node_id), peer_id=joiner.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
    )
    reply = outcome.reply
    # What only the reporter says is outside the signature: changing it invalidates nothing.
    for entry in reply.entries:
        entry.rtt_ms = 42
    assert "rtt_ms" not in mesh.PeerAnnouncement.DESCRIPTOR.fields_by_name
    joined = joiner.receive_gossip_reply(reply, peer_id=a.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert joined.joined and not joined.merged.dropped
    assert sorted(joined.merged.added) == sorted([a.node_id, b.node_id, trio.m.node_id])
    # B's record reached the joiner as the very bytes B signed.
    assert joiner.table.get(b.node_id).record == b.local_record()


def resigned(identity: NodeIdentity, signed: mesh.SignedPeerRecord, **changes) -> mesh.SignedPeerRecord:
    own = mesh.PeerAnnouncement.FromString(signed.record)
    for name, value in changes.items():
        setattr(own, name, value)
    return sign_record(identity, own)


@pytest.mark.parametrize(
    ("tamper", "reason", "code"),
    [
        (lambda i, s: mesh.SignedPeerRecord(record=s.record), "unsigned", mesh.MESH_ERROR_FORGED),
        (
            lambda i, s: mesh.SignedPeerRecord(record=s.record, signature=bytes(64)),
            "bad_signature",
            mesh.MESH_ERROR_FORGED,
        ),
        (
            lambda i, s: resigned(i, s, incarnation=NOW_NS + 86_400 * 10**9),
            "future_incarnation",
            mesh.MESH_ERROR_FUTURE_INCARNATION,
        ),
        (lambda i, s: resigned(i, s, mesh_id="elsewhere"), "other_mesh", mesh.MESH_ERROR_OTHER_MESH),
        (lambda i, s: resigned(i, s, role=mesh.NODE_ROLE_HOST), "malformed", mesh.MESH_ERROR_MALFORMED),
    ],
)
def test_a_bad_record_of_the_sender_itself_refuses_the_frame(trio, tamper, reason, code):
    a, m = trio.a, trio.m
    before = a.table.get(m.node_id).record
    frame = m.gossip_frame(a.node_id)
    frame.entries[0].record.CopyFrom(tamper(trio.m_identity, frame.entries[0].record))
    with pytest.raises(MeshRefusal) as info:
        a.receive_gossip(frame, peer_id=m.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert info.value.code == code
    assert a.record_drops == {reason: 1}
    assert a.table.get(m.node_id).record == before


def test_a_frame_without_the_senders_record_is_malformed(trio):
    a, m = trio.a, trio.m
    frame = m.gossip_frame(a.node_id)
    del frame.entries[0]
    with pytest.raises(MeshRefusal) as info:
        a.receive_gossip(frame, peer_id=m.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert info.value.code == mesh.MESH_ERROR_MALFORMED


def test_a_record_identical_to_the_held_one_is_not_verified_again(trio, monkeypatch):
    a, b, m = trio.a, trio.b, trio.m
    verified: list[bytes] = []
    real_verify = gossip_records.verify_record

    def counting(signed, announcement, **kwargs):
        verified.append(bytes(announcement.endpoint_id))
        return real_verify(signed, announcement, **kwargs)

    monkeypatch.setattr(gossip_records, "verify_record", counting)
    m.receive_gossip(b.gossip_frame(m.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    verified.clear()
    m.heartbeat()  # m's record changes; the B record it relays does not
    a.receive_gossip(m.gossip_frame(a.node_id), peer_id=m.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert verified == [m.node_id]
