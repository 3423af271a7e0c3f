"""The relay state machine: registration, forwarding, queues, fairness, limits (no I/O)."""

from __future__ import annotations

import time

import pytest
from relay_helpers import Member, invited_joiner, new_member, register_frame
from relay_helpers import RelayDriver as Relay

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import relay
from meshnode.wire.pb import mesh
from relay.core import FramesReady, RelayCore, RelayPolicy

MiB = 1024 * 1024
SECOND = 1_000_000_000


# -- registration -----------------------------------------------------------------


def test_member_registers_with_certificate_and_gets_limits_in_the_challenge() -> None:
    r = Relay(RelayPolicy(keepalive_s=5))
    conn, challenge = r.connect(r.member().node_id)
    assert len(challenge) == p.CHALLENGE_BYTES
    member = r.member()
    conn = r.register(member)
    assert r.core.registered_node(conn) == member.node_id
    assert not r.core.is_closing(conn)


def test_challenges_are_fresh_per_connection() -> None:
    r = Relay()
    member = r.member()
    assert r.connect(member.node_id)[1] != r.connect(member.node_id)[1]


def test_joiner_with_invite_proof_for_this_relay_registers() -> None:
    r = Relay()
    joiner = invited_joiner(r.mesh_key, verifier_id=r.relay_id)
    r.register(joiner)


def test_registration_without_membership_credential_is_refused() -> None:
    r = Relay()
    stranger = r.member()
    conn, challenge = r.connect(stranger.node_id)
    r.feed(conn, register_frame(stranger, relay_id=r.relay_id, challenge=challenge, proof=None))
    refusal = r.refusal_of(conn)
    assert refusal.code == p.NOT_A_MEMBER
    assert refusal.membership_error == mesh.MESH_ERROR_NO_CREDENTIAL
    assert r.core.registered_node(conn) is None
    # Nothing can be delivered to it: members are told it is unknown.
    member = r.member()
    sender = r.register(member)
    r.send(sender, stranger.node_id, b"hello", send_id=7)
    (message,) = r.drain(sender)
    assert message.send_refused.refusal.code == p.DESTINATION_UNKNOWN
    assert message.send_refused.send_id == 7
    assert r.drain(conn) == []


def test_invite_proof_made_for_another_verifier_is_refused() -> None:
    r = Relay()
    joiner = invited_joiner(r.mesh_key, verifier_id=NodeIdentity.generate().node_id)
    conn, challenge = r.connect(joiner.node_id)
    r.feed(conn, register_frame(joiner, relay_id=r.relay_id, challenge=challenge))
    refusal = r.refusal_of(conn)
    assert refusal.code == p.NOT_A_MEMBER
    assert refusal.membership_error == mesh.MESH_ERROR_FORGED


def test_expired_invite_is_refused() -> None:
    r = Relay()
    joiner = invited_joiner(r.mesh_key, verifier_id=r.relay_id, ttl_s=60, now=time.time() - 3600)
    conn, challenge = r.connect(joiner.node_id)
    r.feed(conn, register_frame(joiner, relay_id=r.relay_id, challenge=challenge))
    refusal = r.refusal_of(conn)
    assert (refusal.code, refusal.membership_error) == (p.NOT_A_MEMBER, mesh.MESH_ERROR_INVITE_EXPIRED)


def test_certificate_of_another_mesh_is_refused() -> None:
    r = Relay()
    foreigner = new_member(MeshKey.generate())
    conn, challenge = r.connect(foreigner.node_id)
    # Claims the relay's mesh with a certificate from another mesh.
    r.feed(
        conn, register_frame(foreigner, relay_id=r.relay_id, challenge=challenge, mesh_id=r.mesh_key.mesh_id)
    )
    refusal = r.refusal_of(conn)
    assert (refusal.code, refusal.membership_error) == (p.NOT_A_MEMBER, mesh.MESH_ERROR_OTHER_MESH)


def test_mesh_the_relay_does_not_serve_is_refused() -> None:
    r = Relay()
    foreigner = new_member(MeshKey.generate())
    conn, challenge = r.connect(foreigner.node_id)
    r.feed(conn, register_frame(foreigner, relay_id=r.relay_id, challenge=challenge))
    refusal = r.refusal_of(conn)
    assert (refusal.code, refusal.membership_error) == (p.NOT_A_MEMBER, mesh.MESH_ERROR_OTHER_MESH)


def test_claiming_an_id_without_its_key_is_refused_identity_mismatch() -> None:
    """The thief has the victim's certificate but authenticated TLS with its own key."""
    r = Relay()
    victim, thief = r.member(), r.member()
    conn, challenge = r.connect(thief.node_id)
    stolen = Member(identity=thief.identity, proof=victim.proof, mesh_id=victim.mesh_id)
    r.feed(conn, register_frame(stolen, relay_id=r.relay_id, challenge=challenge, node_id=victim.node_id))
    assert r.refusal_of(conn).code == p.IDENTITY_MISMATCH


def test_signature_by_another_key_is_refused_bad_signature() -> None:
    r = Relay()
    member, other = r.member(), r.member()
    conn, challenge = r.connect(member.node_id)
    r.feed(conn, register_frame(member, relay_id=r.relay_id, challenge=challenge, signer=other.identity))
    assert r.refusal_of(conn).code == p.BAD_SIGNATURE


def test_signature_over_another_connections_challenge_is_refused() -> None:
    r = Relay()
    member = r.member()
    _first, old_challenge = r.connect(member.node_id)
    conn, _challenge = r.connect(member.node_id)
    r.feed(conn, register_frame(member, relay_id=r.relay_id, challenge=old_challenge))
    assert r.refusal_of(conn).code == p.BAD_SIGNATURE


def test_send_before_registration_is_a_protocol_error() -> None:
    r = Relay()
    member = r.member()
    conn, _ = r.connect(member.node_id)
    r.send(conn, r.member().node_id, b"x")
    assert r.refusal_of(conn).code == p.PROTOCOL


def test_second_register_on_one_connection_is_a_protocol_error() -> None:
    r = Relay()
    member = r.member()
    conn = r.register(member)
    r.feed(conn, register_frame(member, relay_id=r.relay_id, challenge=b"\0" * 32))
    assert r.refusal_of(conn).code == p.PROTOCOL


def test_garbage_frame_is_malformed() -> None:
    r = Relay()
    conn, _ = r.connect(r.member().node_id)
    r.feed(conn, b"\xff\xff\xff")
    assert r.refusal_of(conn).code == p.MALFORMED


def test_registration_timeout() -> None:
    r = Relay(RelayPolicy(registration_timeout_s=5))
    conn, _ = r.connect(r.member().node_id)
    assert r.core.get_timer() == r.now + 5 * SECOND
    r.core.handle_timer(r.now + 5 * SECOND - 1)
    assert not r.core.is_closing(conn)
    r.core.handle_timer(r.now + 5 * SECOND)
    assert r.refusal_of(conn).code == p.REGISTRATION_TIMEOUT
    assert r.core.get_timer() is None


def test_keepalive_must_be_under_the_nat_timeout() -> None:
    assert RelayPolicy().keepalive_s < 30
    with pytest.raises(ValueError, match="under 30 s"):
        RelayPolicy(keepalive_s=30)


# -- forwarding -------------------------------------------------------------------


def test_frame_is_delivered_with_source_id_and_channel_unchanged() -> None:
    r = Relay()
    a, b = r.member(), r.member()
    conn_a, conn_b = r.register(a), r.register(b)
    payload = bytes(range(256)) * 10
    r.send(conn_a, b.node_id, payload, channel=12345)
    assert FramesReady(conn_b) in r.core.take_events()
    assert r.core.take_events() == []
    (message,) = r.drain(conn_b)
    assert message.deliver.source_id == a.node_id
    assert message.deliver.channel == 12345
    assert message.deliver.payload == payload
    assert r.drain(conn_a) == []
    assert r.core.stats.frames_forwarded == 1


def test_frames_from_one_sender_keep_their_order() -> None:
    r = Relay()
    a, b = r.member(), r.member()
    conn_a, conn_b = r.register(a), r.register(b)
    for i in range(50):
        r.send(conn_a, b.node_id, i.to_bytes(2, "little") * (i + 1))
    got = [int.from_bytes(m.deliver.payload[:2], "little") for m in r.drain(conn_b)]
    assert got == list(range(50))


def test_oversized_payload_is_refused_and_the_client_stays() -> None:
    r = Relay(RelayPolicy(max_payload_bytes=1024))
    a, b = r.member(), r.member()
    conn_a, conn_b = r.register(a), r.register(b)
    r.send(conn_a, b.node_id, b"x" * 1025, send_id=3)
    (message,) = r.drain(conn_a)
    assert message.send_refused.refusal.code == p.PAYLOAD_TOO_LARGE
    assert message.send_refused.send_id == 3
    assert not r.core.is_closing(conn_a)
    r.send(conn_a, b.node_id, b"x" * 1024)
    assert len(r.drain(conn_b)) == 1


def test_no_forwarding_across_meshes() -> None:
    other_mesh = MeshKey.generate()
    r = Relay()
    r.core = RelayCore(r.relay_id, {r.mesh_key.mesh_id, other_mesh.mesh_id})
    a, foreign = r.member(), new_member(other_mesh)
    conn_a = r.register(a)
    conn_f = r.register(foreign)
    r.send(conn_a, foreign.node_id, b"hi")
    (message,) = r.drain(conn_a)
    assert message.send_refused.refusal.code == p.DESTINATION_UNKNOWN
    assert r.drain(conn_f) == []


def test_queue_overflow_refuses_the_frame_and_never_blocks() -> None:
    policy = RelayPolicy(
        max_payload_bytes=64 * 1024,
        source_queue_bytes=200 * 1024,
        destination_queue_bytes=320 * 1024,
        total_queue_bytes=320 * 1024,
    )
    r = Relay(policy)
    a, c, b = r.member(), r.member(), r.member()
    conn_a, conn_c, conn_b = r.register(a), r.register(c), r.register(b)
    chunk = b"a" * (60 * 1024)
    for i in range(4):  # B does not read
        r.send(conn_a, b.node_id, chunk, send_id=i)
    (refused,) = r.drain(conn_a)
    assert refused.send_refused.send_id == 3
    assert refused.send_refused.refusal.code == p.QUEUE_FULL
    assert "sender's share" in refused.send_refused.refusal.detail
    # Another sender still has room in the destination's queue...
    r.send(conn_c, b.node_id, chunk)
    assert r.drain(conn_c) == []
    # ...until the destination's whole queue is full.
    r.send(conn_c, b.node_id, chunk)
    r.send(conn_c, b.node_id, chunk)
    (refused,) = r.drain(conn_c)
    assert refused.send_refused.refusal.code == p.QUEUE_FULL
    assert r.core.queued_bytes_for(b.node_id) <= policy.destination_queue_bytes
    # Draining frees the budget again.
    assert len(r.drain(conn_b)) == 5
    r.send(conn_a, b.node_id, chunk)
    assert r.drain(conn_a) == []
    assert r.core.stats.queued_bytes > 0


def test_flood_from_one_sender_does_not_starve_another() -> None:
    r = Relay()
    flooder, quiet, b = r.member(), r.member(), r.member()
    conn_f, conn_q, conn_b = r.register(flooder), r.register(quiet), r.register(b)
    for _ in range(200):
        r.send(conn_f, b.node_id, b"f" * 16 * 1024)
    for i in range(3):
        r.send(conn_q, b.node_id, b"q%d" % i)
    assert r.drain(conn_f) == [] and r.drain(conn_q) == []
    order = [m.deliver.source_id for m in r.drain(conn_b)]
    assert len(order) == 203
    quiet_positions = [i for i, source in enumerate(order) if source == quiet.node_id]
    # Round robin by bytes: the quiet sender's frames go out within the first turns,
    # not after the flood (a FIFO would put them at 200-202).
    assert quiet_positions[-1] < 20, quiet_positions


def test_second_registration_replaces_the_first_and_inherits_queued_frames() -> None:
    r = Relay()
    a, b = r.member(), r.member()
    conn_a, old_b = r.register(a), r.register(b)
    r.send(conn_a, b.node_id, b"queued")
    new_b, challenge = r.connect(b.node_id)
    r.feed(new_b, register_frame(b, relay_id=r.relay_id, challenge=challenge))
    registered, inherited = r.drain(new_b)
    assert registered.registered.node_id == b.node_id
    assert inherited.deliver.payload == b"queued"
    refusal = r.drain(old_b)[-1]
    assert refusal.refused.code == p.REPLACED
    assert r.core.is_closing(old_b)
    assert r.core.stats.replaced == 1
    # The old connection going away does not unregister the id.
    r.core.connection_lost(old_b)
    r.send(conn_a, b.node_id, b"after")
    assert r.drain(conn_a) == []
    assert [m.deliver.payload for m in r.drain(new_b)] == [b"after"]


def test_a_member_is_told_where_the_relay_sees_it_and_again_when_that_changes() -> None:
    r = Relay()
    member = r.member()
    conn = 99
    r.core.connection_made(conn, member.node_id, r.now, source="198.51.100.7", address="198.51.100.7:40001")
    (challenge,) = r.drain(conn)
    r.core.address_changed(conn, "198.51.100.7:40002")  # not registered yet: nothing to tell
    assert r.drain(conn) == []
    r.feed(conn, register_frame(member, relay_id=r.relay_id, challenge=challenge.challenge.challenge))
    (registered,) = r.drain(conn)
    assert registered.registered.observed_address == "198.51.100.7:40002"
    # Its NAT remapped it: told once, and only when the address really changed.
    r.core.address_changed(conn, "198.51.100.7:51000")
    r.core.address_changed(conn, "198.51.100.7:51000")
    (observed,) = r.drain(conn)
    assert observed.observed.observed_address == "198.51.100.7:51000"


def test_a_relay_naming_an_observed_address_that_is_no_address_is_malformed() -> None:
    for message in (
        relay.RelayServerMessage(registered=relay.RelayRegistered(observed_address="nowhere")),
        relay.RelayServerMessage(observed=relay.RelayObserved(observed_address="10.0.0.1:99999")),
    ):
        with pytest.raises(p.RelayRefused) as refused:
            p.decode_server_message(message.SerializeToString())
        assert refused.value.code == p.MALFORMED


def test_senders_are_told_when_a_destination_goes_away() -> None:
    r = Relay()
    a, b, bystander = r.member(), r.member(), r.member()
    conn_a, conn_b, conn_x = r.register(a), r.register(b), r.register(bystander)
    r.send(conn_a, b.node_id, b"unread")
    r.core.connection_lost(conn_b)
    (message,) = r.drain(conn_a)
    assert message.peer_gone.peer_id == b.node_id
    assert r.drain(conn_x) == []
    assert r.core.stats.queued_bytes == 0
    r.send(conn_a, b.node_id, b"late")
    assert r.drain(conn_a)[0].send_refused.refusal.code == p.DESTINATION_UNKNOWN


def test_rate_limit_pauses_reading_from_the_client() -> None:
    r = Relay(
        RelayPolicy(
            rate_bytes_per_s=1 * MiB, burst_bytes=256 * 1024, rate_frames_per_s=1000, burst_frames=100
        )
    )
    a, b = r.member(), r.member()
    conn_a, _conn_b = r.register(a), r.register(b)
    assert r.core.read_delay_ns(conn_a, r.now) == 0
    for _ in range(3):
        r.send(conn_a, b.node_id, b"x" * 128 * 1024)
    delay = r.core.read_delay_ns(conn_a, r.now)
    assert delay == pytest.approx((3 * 128 * 1024 - 256 * 1024) / MiB * SECOND, rel=0.01)
    assert r.core.read_delay_ns(conn_a, r.now + delay) == 0
    # The frame bucket limits floods of tiny frames the same way.
    for _ in range(150):
        r.send(conn_a, b.node_id, b"")
    assert r.core.read_delay_ns(conn_a, r.now + delay) > 0


def test_client_that_does_not_read_its_refusals_is_closed() -> None:
    r = Relay(RelayPolicy(max_control_backlog=10))
    a = r.member()
    conn_a = r.register(a)
    for _ in range(11):
        r.send(conn_a, r.member().node_id, b"to nobody")
    assert r.refusal_of(conn_a).code == p.OVERLOADED


def test_shutdown_tells_every_client() -> None:
    r = Relay()
    conns = [r.register(r.member()) for _ in range(3)]
    r.core.shutdown()
    assert all(r.refusal_of(conn).code == p.SHUTTING_DOWN for conn in conns)
