"""The admin-signed mesh policy (issue 56): only the mesh key signs one, every node checks one it was
handed by anybody, the newest stands whatever order they arrive in, and a bad one is refused with
its exact code."""

from __future__ import annotations

import pytest

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.membership.credentials import MeshKey
from meshnode.membership.mesh_policy import (
    MAX_CLEARED,
    POLICY_TAG,
    PolicyHolder,
    sign_policy,
    verify_policy,
)
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NOW = 1_900_000_000.0
MESH_KEY = MeshKey.from_seed(b"\x01" * 32)
ADMIN = b"\xaa" * 32
ACCUSED = b"\xcc" * 32


def policy(quarantine: bool = True, *, at: float = NOW, cleared=(), key: MeshKey = MESH_KEY):
    return sign_policy(key, issuer_id=ADMIN, unix_now=at, quarantine_on_evidence=quarantine, cleared=cleared)


def test_a_policy_verifies_and_says_what_the_admin_signed():
    verified = verify_policy(policy(cleared=[ACCUSED]), mesh_id=MESH_KEY.mesh_id)
    assert verified.quarantine_on_evidence and verified.cleared == {ACCUSED}
    assert verified.issuer_id == ADMIN and verified.issued_unix == int(NOW)


def forged_by_a_member() -> membership.MeshPolicy:
    """The mesh's public key named in the body, the signature a member's own key's."""
    body = policy().body
    return membership.MeshPolicy(body=body, signature=MeshKey.generate().sign(POLICY_TAG, body))


@pytest.mark.parametrize(
    "make, code",
    [
        (forged_by_a_member, mesh.MESH_ERROR_FORGED),
        (lambda: policy(key=MeshKey.from_seed(b"\x02" * 32)), mesh.MESH_ERROR_OTHER_MESH),
        (lambda: membership.MeshPolicy(body=b"\xff\xff", signature=b"s"), mesh.MESH_ERROR_MALFORMED),
        (lambda: membership.MeshPolicy(body=b"\x0a" * 5000, signature=b"s"), mesh.MESH_ERROR_MALFORMED),
    ],
)
def test_a_policy_not_signed_by_this_meshs_key_is_refused_with_its_code(make, code):
    with pytest.raises(MeshRefusal) as caught:
        verify_policy(make(), mesh_id=MESH_KEY.mesh_id)
    assert caught.value.code == code
    holder = PolicyHolder(MESH_KEY.mesh_id)
    assert not holder.learn(make())
    assert holder.current is None and not holder.quarantines()
    assert holder.refused == {mesh.MeshErrorCode.Name(code): 1}


def test_the_newest_policy_stands_in_whatever_order_they_arrive():
    older, newer = policy(True, at=NOW), policy(False, at=NOW + 10, cleared=[ACCUSED])
    for order in ([older, newer], [newer, older]):
        holder = PolicyHolder(MESH_KEY.mesh_id)
        for each in order:
            holder.learn(each)
        assert holder.current is not None and holder.current.signed == newer
        assert not holder.quarantines() and holder.cleared() == {ACCUSED}


def test_a_policy_clears_a_bounded_number_of_nodes():
    with pytest.raises(ValueError):
        policy(cleared=[bytes([i]) * 32 for i in range(MAX_CLEARED + 1)])


def test_a_policy_that_requires_handoffs_says_so_and_the_default_does_not():
    default = PolicyHolder(MESH_KEY.mesh_id)
    assert default.learn(policy()) and not default.requires_handoffs()
    assert default.to_json() is not None and default.to_json()["require_handoffs"] is False
    signed = sign_policy(
        MESH_KEY, issuer_id=ADMIN, unix_now=NOW + 1, quarantine_on_evidence=False, require_handoffs=True
    )
    assert verify_policy(signed, mesh_id=MESH_KEY.mesh_id).require_handoffs
    assert default.learn(signed) and default.requires_handoffs() and not default.quarantines()
    assert PolicyHolder(MESH_KEY.mesh_id).requires_handoffs() is False
