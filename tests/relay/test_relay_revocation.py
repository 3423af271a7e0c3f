"""The relay and removals (issue 24): members hand it revocations; it ends and refuses what they name."""

from __future__ import annotations

import time

from relay_helpers import RelayDriver as Relay
from relay_helpers import invited_joiner, register_frame

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.revocation import revoke_invite, revoke_node
from meshnode.relaywire import protocol as p
from meshnode.wire.pb import mesh
from relay.core import RelayCore


def removal_of(r: Relay, node_id: bytes, *, mesh_key: MeshKey | None = None, reason: str = "lost laptop"):
    return revoke_node(
        mesh_key or r.mesh_key,
        node_id=node_id,
        reason=reason,
        issuer_id=NodeIdentity.generate().node_id,
        unix_now=time.time(),
    )


def test_a_revocation_a_member_hands_over_ends_the_removed_registration_and_refuses_the_next() -> None:
    r = Relay()
    reporter, removed = r.member(), r.member()
    reporter_conn, removed_conn = r.register(reporter), r.register(removed)
    (body,) = p.encode_revocations([removal_of(r, removed.node_id)])
    r.feed(reporter_conn, body)
    refusal = r.refusal_of(removed_conn)
    assert refusal.code == p.NOT_A_MEMBER and refusal.membership_error == mesh.MESH_ERROR_REVOKED
    assert "lost laptop" in refusal.detail
    assert not r.core.is_closing(reporter_conn) and r.core.revocations_changed
    # Its data directory is no way back in.
    conn, challenge = r.connect(removed.node_id)
    r.feed(conn, register_frame(removed, relay_id=r.relay_id, challenge=challenge))
    refusal = r.refusal_of(conn)
    assert refusal.code == p.NOT_A_MEMBER and refusal.membership_error == mesh.MESH_ERROR_REVOKED


def test_a_withdrawn_invite_is_refused_at_registration() -> None:
    r = Relay()
    joiner = invited_joiner(r.mesh_key, verifier_id=r.relay_id)
    invite_id = bytes(membership.InviteBody.FromString(joiner.proof.invite.body).invite_public_key)
    withdrawn = revoke_invite(
        r.mesh_key, invite_id=invite_id, reason="", issuer_id=joiner.node_id, unix_now=time.time()
    )
    r.core = RelayCore(r.relay_id, {r.mesh_key.mesh_id}, revocations=[withdrawn])
    conn, challenge = r.connect(joiner.node_id)
    r.feed(conn, register_frame(joiner, relay_id=r.relay_id, challenge=challenge))
    refusal = r.refusal_of(conn)
    assert refusal.code == p.NOT_A_MEMBER and refusal.membership_error == mesh.MESH_ERROR_INVITE_REVOKED


def test_stored_revocations_survive_a_restart_and_forged_or_foreign_ones_are_ignored() -> None:
    r = Relay()
    reporter, victim = r.member(), r.member()
    reporter_conn, victim_conn = r.register(reporter), r.register(victim)
    foreign = removal_of(r, victim.node_id, mesh_key=MeshKey.generate())
    forged = removal_of(r, victim.node_id)
    forged.signature = bytes(64)
    (body,) = p.encode_revocations([foreign, forged])
    r.feed(reporter_conn, body)
    assert not r.core.is_closing(victim_conn) and r.core.revocations() == []
    genuine = removal_of(r, victim.node_id)
    (body,) = p.encode_revocations([genuine])
    r.feed(reporter_conn, body)
    assert r.core.revocations() == [genuine]
    restarted = RelayCore(r.relay_id, {r.mesh_key.mesh_id}, revocations=[foreign, forged, genuine])
    assert restarted.revocations() == [genuine] and not restarted.revocations_changed


def test_revocations_before_registration_are_a_protocol_error() -> None:
    r = Relay()
    member = r.member()
    conn, _challenge = r.connect(member.node_id)
    (body,) = p.encode_revocations([removal_of(r, member.node_id)])
    r.feed(conn, body)
    assert r.refusal_of(conn).code == p.PROTOCOL
