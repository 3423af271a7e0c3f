"""The admin-signed mesh policy: what nodes do on their own when audit evidence names a member. Pure.

A :class:`MeshPolicy` is the mesh key's signature over a ``MeshPolicyBody``, so only an admin
can set one, and any node checks one it was handed by anybody (it rides on every gossip
frame). The newest a node verified stands (:class:`PolicyHolder`): by ``issued_unix``, then by
the body's bytes, so that every node settles on the same one whatever order they arrive in.

What it says:

* ``quarantine_on_evidence``: a node that verified evidence against a member quarantines it:
  routes leave it out (they do anyway) and so does placement, which counts neither its claims
  nor the layers it serves, and its served hop refuses a route that forwards to it
  (:mod:`meshnode.dataplane.hop_rules`);
* ``cleared``: members an admin cleared despite evidence against them; the evidence then
  changes nothing, not even the routes of the head that holds it;
* ``require_handoffs``: a hop refuses a unit of float32 hidden states that comes without its
  sender's signed handoff (:mod:`meshnode.dataplane.handoff_check`), and heads route only
  through hops that announce they state them (``ServedShard.states_handoffs``), so that a node
  that never states what it forwards cannot pass for an older node and escape attribution.

Removal stays the revocation's business (:mod:`meshnode.membership.revocation`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NODE_ID_BYTES, short_id, verify_signature
from meshnode.membership.credentials import MeshKey, mesh_id_from_public_key
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

POLICY_TAG = b"meshnode/v1/mesh-policy\0"
MAX_CLEARED = 64
# A body with MAX_CLEARED ids and its few fields is under 3 KiB; a larger one is not parsed.
MAX_POLICY_BYTES = 4096


@dataclass(frozen=True)
class Policy:
    """A verified policy."""

    quarantine_on_evidence: bool
    cleared: frozenset[bytes]
    require_handoffs: bool
    issuer_id: bytes
    issued_unix: int
    signed: membership.MeshPolicy

    def newer_than(self, other: Policy) -> bool:
        return (self.issued_unix, bytes(self.signed.body)) > (other.issued_unix, bytes(other.signed.body))

    def to_json(self) -> dict[str, object]:
        return {
            "quarantine_on_evidence": self.quarantine_on_evidence,
            "cleared": sorted(node_id.hex() for node_id in self.cleared),
            "require_handoffs": self.require_handoffs,
            "by": short_id(self.issuer_id),
            "issued_unix": self.issued_unix,
        }


def sign_policy(
    mesh_key: MeshKey,
    *,
    issuer_id: bytes,
    unix_now: float,
    quarantine_on_evidence: bool,
    cleared: Iterable[bytes] = (),
    require_handoffs: bool = False,
) -> membership.MeshPolicy:
    ids = sorted(set(cleared))
    if len(ids) > MAX_CLEARED:
        raise ValueError(f"a policy clears at most {MAX_CLEARED} nodes")
    if any(len(node_id) != NODE_ID_BYTES for node_id in ids):
        raise ValueError("a node id is 32 bytes")
    body = membership.MeshPolicyBody(
        mesh_public_key=mesh_key.public_key,
        issuer_id=issuer_id,
        issued_unix=int(unix_now),
        quarantine_on_evidence=quarantine_on_evidence,
        cleared=ids,
        require_handoffs=require_handoffs,
    ).SerializeToString(deterministic=True)
    return membership.MeshPolicy(body=body, signature=mesh_key.sign(POLICY_TAG, body))


def verify_policy(policy: membership.MeshPolicy, *, mesh_id: str) -> Policy:
    """Decode and verify one policy for ``mesh_id``; refuses with the exact code."""
    if len(policy.body) > MAX_POLICY_BYTES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"a mesh policy over {MAX_POLICY_BYTES} bytes")
    try:
        body = membership.MeshPolicyBody.FromString(policy.body)
    except DecodeError:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "mesh policy does not decode") from None
    if len(body.mesh_public_key) != NODE_ID_BYTES or len(body.issuer_id) != NODE_ID_BYTES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "mesh policy keys must be 32 bytes")
    if len(body.cleared) > MAX_CLEARED or any(len(n) != NODE_ID_BYTES for n in body.cleared):
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"mesh policy clears more than {MAX_CLEARED} node ids")
    if not verify_signature(bytes(body.mesh_public_key), policy.signature, POLICY_TAG + policy.body):
        raise MeshRefusal(mesh.MESH_ERROR_FORGED, "mesh policy signature does not verify")
    if mesh_id_from_public_key(bytes(body.mesh_public_key)) != mesh_id:
        raise MeshRefusal(mesh.MESH_ERROR_OTHER_MESH, "mesh policy is for another mesh")
    return Policy(
        quarantine_on_evidence=body.quarantine_on_evidence,
        cleared=frozenset(bytes(n) for n in body.cleared),
        require_handoffs=body.require_handoffs,
        issuer_id=bytes(body.issuer_id),
        issued_unix=body.issued_unix,
        signed=membership.MeshPolicy(body=policy.body, signature=policy.signature),
    )


class PolicyHolder:
    """The newest verified policy of one mesh (None: no admin set one; nothing is quarantined)."""

    def __init__(self, mesh_id: str) -> None:
        self.mesh_id = mesh_id
        self.current: Policy | None = None
        # Refused policies, by code name (the status report's reading).
        self.refused: dict[str, int] = {}

    def learn(self, signed: membership.MeshPolicy) -> bool:
        """Whether ``signed`` verified and is newer than the one held (it then stands)."""
        if self.current is not None and signed == self.current.signed:
            return False
        try:
            policy = verify_policy(signed, mesh_id=self.mesh_id)
        except MeshRefusal as refusal:
            self.refused[refusal.code_name] = self.refused.get(refusal.code_name, 0) + 1
            return False
        if self.current is not None and not policy.newer_than(self.current):
            return False
        self.current = policy
        return True

    def cleared(self) -> frozenset[bytes]:
        return self.current.cleared if self.current is not None else frozenset()

    def quarantines(self) -> bool:
        return self.current is not None and self.current.quarantine_on_evidence

    def requires_handoffs(self) -> bool:
        return self.current is not None and self.current.require_handoffs

    def to_json(self) -> dict[str, object] | None:
        return self.current.to_json() if self.current is not None else None


__all__ = [
    "MAX_CLEARED",
    "POLICY_TAG",
    "Policy",
    "PolicyHolder",
    "sign_policy",
    "verify_policy",
]
