"""Invites, member certificates, membership proofs and the membership store."""

import base64
import stat
import time

import pytest

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity, private_key_seed
from meshnode.membership.credentials import (
    MAX_INVITE_TTL_S,
    Endpoint,
    MeshKey,
    certificate_proof,
    check_invite,
    create_invite,
    decode_invite_token,
    encode_invite_token,
    issue_certificate,
    make_grant,
    make_invite_proof,
    mesh_id_from_public_key,
    open_grant,
    verify_membership_proof,
)
from meshnode.membership.store import DataDir, MembershipState, StoreError
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NOW = 1_800_000_000.0


def new_invite(mesh_key, issuer, *, ttl=3600.0, now=NOW):
    bootstrap = [Endpoint(issuer.node_id, "127.0.0.1:7447")]
    relays = [Endpoint(NodeIdentity.generate().node_id, "relay.example:443")]
    return create_invite(
        mesh_key, issuer_id=issuer.node_id, bootstrap=bootstrap, relays=relays, ttl_s=ttl, unix_now=now
    )


def refusal_code(call):
    with pytest.raises(MeshRefusal) as info:
        call()
    return info.value.code


@pytest.fixture
def mesh_key():
    return MeshKey.generate()


@pytest.fixture
def issuer():
    return NodeIdentity.generate()


def test_mesh_id_derives_from_the_public_key_only(mesh_key):
    assert mesh_key.mesh_id == mesh_id_from_public_key(mesh_key.public_key)
    assert len(mesh_key.mesh_id) == 26 and mesh_key.mesh_id.isalnum()
    assert MeshKey.from_seed(mesh_key.seed()).mesh_id == mesh_key.mesh_id
    assert MeshKey.generate().mesh_id != mesh_key.mesh_id
    assert mesh_key.mesh_id in repr(mesh_key) and mesh_key.seed().hex() not in repr(mesh_key)


def test_invite_token_round_trips_and_checks(mesh_key, issuer):
    invite = new_invite(mesh_key, issuer)
    token = encode_invite_token(invite)
    assert "=" not in token and "+" not in token and "/" not in token
    decoded = decode_invite_token(f"  {token}\n")
    check_invite(decoded, unix_now=NOW + 10)
    assert decoded.mesh_id == mesh_key.mesh_id
    assert decoded.bootstrap == invite.bootstrap and decoded.relays == invite.relays
    assert decoded.issuer_id == issuer.node_id
    assert decoded.expires_unix == int(NOW + 3600)
    secret = private_key_seed(decoded.invite_key)
    assert secret.hex() not in repr(decoded) and token not in repr(decoded)


def test_expired_invite_is_refused_at_and_after_expiry(mesh_key, issuer):
    invite = decode_invite_token(encode_invite_token(new_invite(mesh_key, issuer, ttl=60)))
    check_invite(invite, unix_now=NOW + 59)
    assert refusal_code(lambda: check_invite(invite, unix_now=NOW + 60)) == mesh.MESH_ERROR_INVITE_EXPIRED


@pytest.mark.parametrize(
    "text",
    ["", "   ", "!!!not-base64!!!", base64.urlsafe_b64encode(b"\xff\xff\xff garbage").decode(), "A" * 20000],
)
def test_malformed_tokens_are_refused_as_malformed(text):
    assert refusal_code(lambda: decode_invite_token(text)) == mesh.MESH_ERROR_MALFORMED


def test_token_with_wrong_version_or_sizes_is_malformed(mesh_key, issuer):
    invite = new_invite(mesh_key, issuer)
    good = membership.InviteToken.FromString(base64.urlsafe_b64decode(encode_invite_token(invite) + "=="))

    def encoded(**changes):
        token = membership.InviteToken()
        token.CopyFrom(good)
        for name, value in changes.items():
            setattr(token, name, value)
        return base64.urlsafe_b64encode(token.SerializeToString()).decode()

    assert refusal_code(lambda: decode_invite_token(encoded(version=2))) == mesh.MESH_ERROR_MALFORMED
    assert (
        refusal_code(lambda: decode_invite_token(encoded(body_signature=b"x"))) == mesh.MESH_ERROR_MALFORMED
    )
    assert (
        refusal_code(lambda: decode_invite_token(encoded(invite_private_key=b"k")))
        == mesh.MESH_ERROR_MALFORMED
    )
    # A secret that does not belong to the signed invite key.
    assert (
        refusal_code(lambda: decode_invite_token(encoded(invite_private_key=bytes(32))))
        == mesh.MESH_ERROR_FORGED
    )


def test_tampered_invite_body_is_forged(mesh_key, issuer):
    invite = new_invite(mesh_key, issuer)
    raw = membership.InviteToken.FromString(base64.urlsafe_b64decode(encode_invite_token(invite) + "=="))
    body = membership.InviteBody.FromString(raw.body)
    body.expires_unix += 10**6  # extend the validity without the mesh key
    raw.body = body.SerializeToString()
    tampered = decode_invite_token(base64.urlsafe_b64encode(raw.SerializeToString()).decode())
    assert refusal_code(lambda: check_invite(tampered, unix_now=NOW)) == mesh.MESH_ERROR_FORGED


def test_every_single_bit_flip_of_a_token_is_refused(mesh_key, issuer):
    raw = base64.urlsafe_b64decode(encode_invite_token(new_invite(mesh_key, issuer)) + "==")
    for position in range(len(raw)):
        for bit in (0x01, 0x02, 0x10, 0x80):
            flipped = bytearray(raw)
            flipped[position] ^= bit
            text = base64.urlsafe_b64encode(bytes(flipped)).decode()
            with pytest.raises(MeshRefusal) as info:
                check_invite(decode_invite_token(text), unix_now=NOW)
            assert info.value.code in (mesh.MESH_ERROR_MALFORMED, mesh.MESH_ERROR_FORGED), (position, bit)


def test_invite_proof_admits_exactly_the_holder_at_the_named_verifier(mesh_key, issuer):
    invite = new_invite(mesh_key, issuer)
    joiner, thief, other_verifier = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
    proof = make_invite_proof(invite, joiner_id=joiner.node_id, verifier_id=issuer.node_id)

    def verify(peer, verifier=issuer, the_proof=proof, now=NOW, mesh_id=mesh_key.mesh_id):
        return verify_membership_proof(
            the_proof,
            mesh_id=mesh_id,
            verifier_id=verifier.node_id,
            authenticated_peer_id=peer.node_id,
            unix_now=now,
        )

    verified = verify(joiner)
    assert verified.via_invite and verified.issuer_id == issuer.node_id
    # A captured proof is useless to another identity or against another verifier.
    assert refusal_code(lambda: verify(thief)) == mesh.MESH_ERROR_FORGED
    assert refusal_code(lambda: verify(joiner, verifier=other_verifier)) == mesh.MESH_ERROR_FORGED
    assert refusal_code(lambda: verify(joiner, now=NOW + 7200)) == mesh.MESH_ERROR_INVITE_EXPIRED
    other_mesh = MeshKey.generate().mesh_id
    assert refusal_code(lambda: verify(joiner, mesh_id=other_mesh)) == mesh.MESH_ERROR_OTHER_MESH
    assert refusal_code(lambda: verify(joiner, the_proof=None)) == mesh.MESH_ERROR_NO_CREDENTIAL
    empty = membership.MembershipProof()
    assert refusal_code(lambda: verify(joiner, the_proof=empty)) == mesh.MESH_ERROR_NO_CREDENTIAL
    broken = membership.MembershipProof()
    broken.CopyFrom(proof)
    broken.invite.body = b"\xff\xff"
    assert refusal_code(lambda: verify(joiner, the_proof=broken)) == mesh.MESH_ERROR_MALFORMED


def test_member_certificate_is_bound_to_mesh_and_node(mesh_key, issuer):
    member = NodeIdentity.generate()
    certificate = issue_certificate(mesh_key, node_id=member.node_id, issuer_id=issuer.node_id, unix_now=NOW)
    proof = certificate_proof(certificate)

    def verify(peer, the_proof=proof, mesh_id=mesh_key.mesh_id):
        return verify_membership_proof(
            the_proof,
            mesh_id=mesh_id,
            verifier_id=issuer.node_id,
            authenticated_peer_id=peer.node_id,
            unix_now=NOW,
        )

    assert not verify(member).via_invite
    assert refusal_code(lambda: verify(issuer)) == mesh.MESH_ERROR_WRONG_IDENTITY
    assert (
        refusal_code(lambda: verify(member, mesh_id=MeshKey.generate().mesh_id)) == mesh.MESH_ERROR_OTHER_MESH
    )
    forged = certificate_proof(
        issue_certificate(MeshKey.generate(), node_id=member.node_id, issuer_id=issuer.node_id, unix_now=NOW)
    )
    forged_body = membership.MemberCertificateBody.FromString(forged.certificate.body)
    forged_body.mesh_public_key = mesh_key.public_key  # claim our mesh, signed by another key
    forged.certificate.body = forged_body.SerializeToString()
    assert refusal_code(lambda: verify(member, the_proof=forged)) == mesh.MESH_ERROR_FORGED


def test_admin_grant_carries_a_usable_mesh_key_and_a_plain_grant_none(mesh_key, issuer):
    member = NodeIdentity.generate()
    certificate = issue_certificate(mesh_key, node_id=member.node_id, issuer_id=issuer.node_id, unix_now=NOW)
    grant = make_grant(certificate, admin_key=mesh_key)

    def open_it(the_grant, node_id=member.node_id, now=NOW):
        return open_grant(the_grant, mesh_id=mesh_key.mesh_id, node_id=node_id, unix_now=now)

    got_key, got_certificate = open_it(grant)
    assert got_key.mesh_id == mesh_key.mesh_id and got_certificate == certificate
    plain_key, plain_certificate = open_it(make_grant(certificate))
    assert plain_key is None and plain_certificate == certificate
    other = make_grant(certificate, admin_key=MeshKey.generate())
    assert refusal_code(lambda: open_it(other)) == mesh.MESH_ERROR_OTHER_MESH
    assert refusal_code(lambda: open_it(grant, node_id=issuer.node_id)) == mesh.MESH_ERROR_WRONG_IDENTITY
    assert refusal_code(lambda: open_it(grant, now=NOW + 25 * 3600)) == mesh.MESH_ERROR_CERTIFICATE_EXPIRED


def test_membership_store_round_trips_with_private_files(tmp_path, mesh_key):
    member = NodeIdentity.generate()
    certificate = issue_certificate(
        mesh_key, node_id=member.node_id, issuer_id=member.node_id, unix_now=time.time()
    )
    peer = Endpoint(NodeIdentity.generate().node_id, "10.0.0.2:7447")
    data_dir = DataDir(tmp_path / "d")
    data_dir.save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate, known_peers=[peer]))
    for name in ("mesh_key", "membership.json"):
        assert stat.S_IMODE((tmp_path / "d" / name).stat().st_mode) == 0o600
    loaded = data_dir.load_membership(member.node_id)
    assert loaded.mesh_id == mesh_key.mesh_id and loaded.known_peers == [peer]
    assert mesh_key.seed().hex() not in repr(loaded)
    assert refusal_code(lambda: data_dir.load_membership(peer.id)) == mesh.MESH_ERROR_WRONG_IDENTITY
    (tmp_path / "d" / "membership.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        data_dir.load_membership(member.node_id)


def test_data_dir_lock_refuses_a_second_node(tmp_path):
    first, second = DataDir(tmp_path), DataDir(tmp_path)
    first.lock()
    try:
        with pytest.raises(StoreError, match="another meshnode"):
            second.lock()
    finally:
        first.unlock()
    second.lock()
    second.unlock()


def test_an_invite_lives_a_month_at_most():
    mesh_key, issuer = MeshKey.generate(), NodeIdentity.generate()
    assert new_invite(mesh_key, issuer, ttl=MAX_INVITE_TTL_S).expires_unix == NOW + MAX_INVITE_TTL_S
    with pytest.raises(ValueError, match="at most 30 days"):
        new_invite(mesh_key, issuer, ttl=MAX_INVITE_TTL_S + 1)
