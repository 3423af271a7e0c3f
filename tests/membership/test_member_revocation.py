"""Authority without I/O: admins sign, plain members cannot; revocations gossip and are obeyed;
certificates expire unless an admin renews them (issue 24)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.mesh_nodes import fast_config, first_member

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import (
    INVITE_BODY_TAG,
    Endpoint,
    MeshKey,
    certificate_proof,
    create_invite,
    issue_certificate,
    make_invite_proof,
    verify_membership_proof,
)
from meshnode.membership.revocation import (
    MAX_NEW_PER_BATCH,
    REVOCATION_TAG,
    RevocationList,
    revoke_invite,
    revoke_node,
    verify_revocation,
)
from meshnode.membership.store import MembershipState
from meshnode.mesh.state import MeshState
from meshnode.metrics import MetricSources, collect, samples_by_name
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal
from meshnode.wire.pb import mesh

NOW = 1_900_000_000.0
MONOTONIC_NS = 5_000_000_000
HOUR = 3600.0


def code_of(call) -> int:
    with pytest.raises(MeshRefusal) as caught:
        call()
    return caught.value.code


def admin_state(mesh_key: MeshKey, identity: NodeIdentity, **kwargs: Any) -> MeshState:
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=NOW, admin=True
    )
    return MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1, addresses=["127.0.0.1:1"]),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
        **kwargs,
    )


def plain_state(
    mesh_key: MeshKey, identity: NodeIdentity, admin_id: bytes, *, ttl: float = 24 * HOUR
) -> MeshState:
    """A member as an admin's grant leaves it: a certificate and no mesh key."""
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=admin_id, unix_now=NOW, ttl_s=ttl
    )
    return MeshState(
        identity=identity,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1, addresses=["127.0.0.1:2"]),
        membership=MembershipState(mesh_key=None, certificate=certificate),
    )


def exchange(opener: MeshState, acceptor: MeshState, *, now: float = NOW):
    """One gossip exchange, opener to acceptor; the acceptor's outcome and the opener's."""
    outcome = acceptor.receive_gossip(
        opener.gossip_frame(acceptor.node_id), peer_id=opener.node_id, now_ns=MONOTONIC_NS, unix_now=now
    )
    reply = opener.receive_gossip_reply(
        outcome.reply, peer_id=acceptor.node_id, now_ns=MONOTONIC_NS, unix_now=now
    )
    return outcome, reply


@pytest.fixture
def mesh_key() -> MeshKey:
    return MeshKey.generate()


# -- who may sign -------------------------------------------------------------------------------


def test_an_invite_joiner_becomes_a_plain_member_without_the_mesh_key(mesh_key):
    admin, joiner = NodeIdentity.generate(), NodeIdentity.generate()
    bootstrap = [Endpoint(admin.node_id, "127.0.0.1:1")]
    invite = create_invite(mesh_key, issuer_id=admin.node_id, bootstrap=bootstrap, unix_now=NOW)
    joining = MeshState(
        identity=joiner,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1),
        membership=None,
        invite=invite,
    )
    outcome, reply = exchange(joining, admin_state(mesh_key, admin))
    assert outcome.via_invite and outcome.invite_id == invite.invite_id and reply.joined
    assert joining.membership is not None and joining.membership.mesh_key is None
    assert not joining.membership.is_admin and not joining.membership.certificate_body.admin
    assert joining.membership.certificate_body.expires_unix == int(NOW + 24 * HOUR)


def test_a_plain_member_cannot_mint_an_invite_or_certificate_any_node_accepts(mesh_key):
    """The model gives plain members no signing power: whatever a member signs with the only key it
    has (its node key) while naming the mesh is FORGED, and it does not admit invite holders."""
    admin, member, stranger = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    member_as_signer = MeshKey.from_seed(member.private_key.private_bytes_raw())
    bootstrap = [Endpoint(member.node_id, "127.0.0.1:2")]

    # An invite: the body names this mesh's public key but is signed by the member.
    forged = create_invite(member_as_signer, issuer_id=member.node_id, bootstrap=bootstrap, unix_now=NOW)
    forged.body.mesh_public_key = mesh_key.public_key
    body_bytes = forged.body.SerializeToString(deterministic=True)
    proof = make_invite_proof(forged, joiner_id=stranger.node_id, verifier_id=admin.node_id)
    proof.invite.body = body_bytes
    proof.invite.body_signature = member_as_signer.sign(INVITE_BODY_TAG, body_bytes)

    def verify(the_proof: membership.MembershipProof) -> object:
        return verify_membership_proof(
            the_proof,
            mesh_id=mesh_key.mesh_id,
            verifier_id=admin.node_id,
            authenticated_peer_id=stranger.node_id,
            unix_now=NOW,
        )

    assert code_of(lambda: verify(proof)) == mesh.MESH_ERROR_FORGED
    # A certificate for the stranger, signed the same way.
    certificate = issue_certificate(
        member_as_signer, node_id=stranger.node_id, issuer_id=member.node_id, unix_now=NOW
    )
    body = membership.MemberCertificateBody.FromString(certificate.body)
    body.mesh_public_key = mesh_key.public_key
    certificate.body = body.SerializeToString(deterministic=True)
    assert code_of(lambda: verify(certificate_proof(certificate))) == mesh.MESH_ERROR_FORGED
    # A revocation, the same way: no node learns it.
    revocation = revoke_node(
        member_as_signer, node_id=admin.node_id, reason="coup", issuer_id=member.node_id, unix_now=NOW
    )
    forged_body = membership.RevocationBody.FromString(revocation.body)
    forged_body.mesh_public_key = mesh_key.public_key
    revocation.body = forged_body.SerializeToString(deterministic=True)
    revocation.signature = member_as_signer.sign(REVOCATION_TAG, revocation.body)
    assert code_of(lambda: verify_revocation(revocation, mesh_id=mesh_key.mesh_id)) == mesh.MESH_ERROR_FORGED
    # And a genuine invite presented to the plain member is not admitted by it.
    plain = plain_state(mesh_key, member, admin.node_id)
    genuine = create_invite(mesh_key, issuer_id=admin.node_id, bootstrap=bootstrap, unix_now=NOW)
    joining = MeshState(
        identity=stranger,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1),
        membership=None,
        invite=genuine,
    )
    assert (
        code_of(
            lambda: plain.receive_gossip(
                joining.gossip_frame(member.node_id),
                peer_id=stranger.node_id,
                now_ns=MONOTONIC_NS,
                unix_now=NOW,
            )
        )
        == mesh.MESH_ERROR_NOT_ADMITTED
    )


def test_a_revocation_verifies_only_for_its_mesh_and_untampered(mesh_key):
    admin, member = NodeIdentity.generate(), NodeIdentity.generate()
    revocation = revoke_node(
        mesh_key, node_id=member.node_id, reason="lost laptop", issuer_id=admin.node_id, unix_now=NOW
    )
    revoked = verify_revocation(revocation, mesh_id=mesh_key.mesh_id)
    assert (revoked.kind, revoked.target, revoked.reason) == ("node", member.node_id, "lost laptop")
    assert code_of(lambda: verify_revocation(revocation, mesh_id=MeshKey.generate().mesh_id)) == (
        mesh.MESH_ERROR_OTHER_MESH
    )
    tampered = membership.Revocation(body=revocation.body + b"\x22\x01x", signature=revocation.signature)
    assert code_of(lambda: verify_revocation(tampered, mesh_id=mesh_key.mesh_id)) == mesh.MESH_ERROR_FORGED
    known = RevocationList(mesh_key.mesh_id)
    learned = known.learn([tampered, revocation, revocation])
    assert learned.refused == 1 and [r.target for r in learned.new] == [member.node_id]
    assert known.learn([revocation]).new == []  # held already: nothing new, nothing re-verified


def test_a_flood_of_forged_revocations_costs_a_bounded_number_of_checks_per_frame(mesh_key):
    admin, member = NodeIdentity.generate(), NodeIdentity.generate()
    genuine = revoke_node(mesh_key, node_id=member.node_id, reason="", issuer_id=admin.node_id, unix_now=NOW)
    forged = [
        membership.Revocation(body=genuine.body, signature=bytes([n % 256, n // 256]) + bytes(62))
        for n in range(2 * MAX_NEW_PER_BATCH)
    ]
    known = RevocationList(mesh_key.mesh_id)
    flooded = known.learn([*forged, genuine])
    assert flooded.refused == MAX_NEW_PER_BATCH and flooded.new == []
    assert known.learn([genuine]).new[0].target == member.node_id  # the next frame gets it through


# -- removal ------------------------------------------------------------------------------------


def test_a_removal_gossips_and_every_state_refuses_the_removed_node_which_learns_why(mesh_key):
    admin, b, c = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    a_state = admin_state(mesh_key, admin)
    b_state, c_state = plain_state(mesh_key, b, admin.node_id), plain_state(mesh_key, c, admin.node_id)
    exchange(b_state, a_state)
    exchange(c_state, a_state)
    exchange(b_state, c_state)
    assert b.node_id in c_state.table and c_state.is_admitted(b.node_id)
    d = NodeIdentity.generate()
    d_state = plain_state(mesh_key, d, admin.node_id)
    exchange(b_state, d_state)
    assert b.node_id in d_state.table

    revocation = revoke_node(
        mesh_key, node_id=b.node_id, reason="lost laptop", issuer_id=admin.node_id, unix_now=NOW
    )
    a_state.learn_revocations([revocation], now_ns=MONOTONIC_NS)
    assert b.node_id not in a_state.table and not a_state.is_admitted(b.node_id)
    # The admin's next frame carries it to C, which drops B at once.
    exchange(a_state, c_state)
    assert [r.target for r in c_state.take_new_revocations()] == [b.node_id]
    assert b.node_id not in c_state.table and not c_state.is_admitted(b.node_id)
    # B's next frame is refused with REVOKED, and the refusal shows B the signed revocation.
    with pytest.raises(MeshRefusal) as refused:
        c_state.receive_gossip(
            b_state.gossip_frame(c.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
        )
    assert refused.value.code == mesh.MESH_ERROR_REVOKED and "lost laptop" in refused.value.detail
    with pytest.raises(RemoteRefusal):
        b_state.receive_gossip_reply(
            c_state.refusal_frame(refused.value), peer_id=c.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
        )
    assert b_state.removed is not None and b_state.removed.reason == "lost laptop"
    # D heard of B before the removal and of the removal not yet: C does not merge B's record from
    # D's frame, and C's reply tells D.
    exchange(d_state, c_state)
    assert b.node_id not in c_state.table and c_state.record_drops["revoked"] == 1
    assert b.node_id not in d_state.table and d_state.revocations.node(b.node_id) is not None


def test_a_bare_refusal_code_does_not_remove_a_node(mesh_key):
    """Any member can send MESH_ERROR_REVOKED; only a verified revocation naming us counts."""
    admin, b, c = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    b_state, c_state = plain_state(mesh_key, b, admin.node_id), plain_state(mesh_key, c, admin.node_id)
    lie = c_state.refusal_frame(MeshRefusal(mesh.MESH_ERROR_REVOKED, "you are out"))
    with pytest.raises(RemoteRefusal) as refused:
        b_state.receive_gossip_reply(lie, peer_id=c.node_id, now_ns=MONOTONIC_NS, unix_now=NOW)
    assert refused.value.code == mesh.MESH_ERROR_REVOKED and b_state.removed is None


def test_a_withdrawn_invite_is_refused_with_its_reason(mesh_key):
    admin, joiner = NodeIdentity.generate(), NodeIdentity.generate()
    bootstrap = [Endpoint(admin.node_id, "127.0.0.1:1")]
    invite = create_invite(mesh_key, issuer_id=admin.node_id, bootstrap=bootstrap, unix_now=NOW)
    a_state = admin_state(mesh_key, admin)
    a_state.learn_revocations(
        [
            revoke_invite(
                mesh_key,
                invite_id=invite.invite_id,
                reason="sent to the wrong chat",
                issuer_id=admin.node_id,
                unix_now=NOW,
            )
        ],
        now_ns=MONOTONIC_NS,
    )
    joining = MeshState(
        identity=joiner,
        mesh_id=mesh_key.mesh_id,
        local=mesh.PeerAnnouncement(incarnation=1),
        membership=None,
        invite=invite,
    )
    with pytest.raises(MeshRefusal) as refused:
        a_state.receive_gossip(
            joining.gossip_frame(admin.node_id), peer_id=joiner.node_id, now_ns=MONOTONIC_NS, unix_now=NOW
        )
    assert refused.value.code == mesh.MESH_ERROR_INVITE_REVOKED
    assert "sent to the wrong chat" in refused.value.detail
    assert a_state.gate.revoked_refusals == {"MESH_ERROR_INVITE_REVOKED": 1}


# -- expiry and renewal -------------------------------------------------------------------------


def test_an_admin_renews_a_member_in_good_standing_before_its_certificate_expires(mesh_key):
    admin, b = NodeIdentity.generate(), NodeIdentity.generate()
    a_state = admin_state(mesh_key, admin, certificate_ttl_s=HOUR)
    b_state = plain_state(mesh_key, b, admin.node_id, ttl=HOUR)
    first, reply = exchange(b_state, a_state)
    assert not first.reply.HasField("membership_grant") and not reply.renewed
    # Past half its lifetime: the admin's reply carries a fresh certificate, and no mesh key.
    later = NOW + 0.6 * HOUR
    outcome, reply = exchange(b_state, a_state, now=later)
    assert outcome.reply.membership_grant.mesh_private_key == b"" and reply.renewed
    assert b_state.membership.certificate_body.expires_unix == int(later) + int(HOUR)
    assert b_state.membership.mesh_key is None
    # Renewed, B is still admitted after the first certificate's end.
    exchange(b_state, a_state, now=NOW + 1.2 * HOUR)


def test_a_certificate_that_was_not_renewed_is_refused_once_expired(mesh_key):
    admin, b, c = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    b_state = plain_state(mesh_key, b, admin.node_id, ttl=HOUR)
    c_state = plain_state(mesh_key, c, admin.node_id, ttl=4 * HOUR)
    exchange(b_state, c_state)  # admitted while current; C is no admin, so nothing renews B
    expired = NOW + HOUR + 1

    def next_frame(state: MeshState) -> object:
        return state.receive_gossip(
            b_state.gossip_frame(state.node_id), peer_id=b.node_id, now_ns=MONOTONIC_NS, unix_now=expired
        )

    assert code_of(lambda: next_frame(c_state)) == mesh.MESH_ERROR_CERTIFICATE_EXPIRED
    assert not c_state.is_admitted(b.node_id)
    # An admin does not renew an expired certificate either: it refuses it the same way.
    assert code_of(lambda: next_frame(admin_state(mesh_key, admin))) == mesh.MESH_ERROR_CERTIFICATE_EXPIRED
    assert b_state.own_certificate_expired(expired) and not b_state.own_certificate_expired(NOW)


def test_an_admin_grant_hands_over_the_mesh_key_and_an_admin_certificate(mesh_key):
    admin, b = NodeIdentity.generate(), NodeIdentity.generate()
    a_state = admin_state(mesh_key, admin)
    b_state = plain_state(mesh_key, b, admin.node_id)
    exchange(b_state, a_state)
    a_state.gate.pending_admins.add(b.node_id)
    _outcome, reply = exchange(b_state, a_state)
    assert reply.renewed and b_state.membership.is_admin
    assert b_state.membership.mesh_key.mesh_id == mesh_key.mesh_id
    assert b_state.membership.certificate_body.admin
    assert a_state.gate.certificates[b.node_id].admin is False  # what B showed before the grant
    exchange(b_state, a_state)
    assert a_state.gate.certificates[b.node_id].admin is True


async def test_metrics_count_refusals_of_revoked_credentials_by_code(tmp_path, mesh_key):
    node = first_member(tmp_path / "admin", fast_config(), mesh_key)
    removed = NodeIdentity.generate()
    removed_state = plain_state(mesh_key, removed, node.node_id)
    node.state.learn_revocations(
        [revoke_node(mesh_key, node_id=removed.node_id, reason="", issuer_id=node.node_id, unix_now=NOW)],
        now_ns=MONOTONIC_NS,
    )
    for _ in range(2):
        with pytest.raises(MeshRefusal):
            node.state.receive_gossip(
                removed_state.gossip_frame(node.node_id),
                peer_id=removed.node_id,
                now_ns=MONOTONIC_NS,
                unix_now=NOW,
            )
    refusals = samples_by_name(await collect(MetricSources(node=node), now=0.0))
    samples = {
        labels["code"]: value for labels, value in refusals["meshnode_revoked_credential_refusals_total"]
    }
    assert samples == {"REVOKED": 2, "INVITE_REVOKED": 0, "CERTIFICATE_EXPIRED": 0}
