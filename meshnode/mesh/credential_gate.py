"""What a node checks of a peer's credentials on every gossip frame, and what an admin grants. Pure.

:class:`CredentialGate` is :class:`~meshnode.mesh.state.MeshState`'s keeper of
authority (the trust model is :mod:`meshnode.membership.credentials`'s):

* revocations: every frame's are learned first (:meth:`learn`), so the frame
  that carries a removal is already judged by it;
* admission: a peer not yet admitted proves membership, then the revocation list
  refuses a removed node (``MESH_ERROR_REVOKED``) or a withdrawn invite
  (``MESH_ERROR_INVITE_REVOKED``); an admitted peer is refused once removed, and
  once its certificate expired (``MESH_ERROR_CERTIFICATE_EXPIRED``) — the
  certificate shown on each frame is verified again only when its bytes change
  (a renewal), otherwise the one verified before is checked against the clock;
* grants (admins only): a certificate for an invite holder; a renewed one for a
  member past half its certificate's lifetime (never for an expired or removed
  one: the check above refused it first); the mesh key for a node an admin
  promoted with ``meshnode admin grant``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.membership.credentials import (
    DEFAULT_CERTIFICATE_TTL_S,
    VerifiedMembership,
    check_certificate_current,
    issue_certificate,
    make_grant,
    verify_certificate,
    verify_membership_proof,
)
from meshnode.membership.revocation import Learned, RevocationList
from meshnode.membership.store import MembershipState
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh


@dataclass(frozen=True)
class Admission:
    """What one frame's credentials established: ``verified`` is set when the peer was not
    admitted before (its proof was checked now)."""

    verified: VerifiedMembership | None


class CredentialGate:
    def __init__(
        self,
        *,
        node_id: bytes,
        mesh_id: str,
        revocations: RevocationList | None = None,
        certificate_ttl_s: float = DEFAULT_CERTIFICATE_TTL_S,
    ) -> None:
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.revocations = revocations if revocations is not None else RevocationList(mesh_id)
        self.certificate_ttl_s = certificate_ttl_s
        # The last certificate each peer showed, verified (status shows expiry and admin).
        self.certificates: dict[bytes, membership.MemberCertificateBody] = {}
        self._certificate_bytes: dict[bytes, bytes] = {}
        # Nodes an admin promoted that have not received the mesh key yet.
        self.pending_admins: set[bytes] = set()
        # Refusals of removed nodes, withdrawn invites and expired certificates, by code name.
        self.revoked_refusals: dict[str, int] = {}

    def learn(self, revocations: list[membership.Revocation]) -> Learned:
        return self.revocations.learn(revocations)

    def check(self, frame: mesh.GossipFrame, *, peer_id: bytes, admitted: bool, unix_now: float) -> Admission:
        """Refuses (``MeshRefusal``) a removed peer, a withdrawn invite, an expired certificate, or a
        bad proof from a peer not admitted yet."""
        try:
            return self._check(frame, peer_id, admitted, unix_now)
        except MeshRefusal as refusal:
            if refusal.code in REVOCATION_CODES:
                self.revoked_refusals[refusal.code_name] = self.revoked_refusals.get(refusal.code_name, 0) + 1
            raise

    def check_not_revoked(self, peer_id: bytes) -> None:
        """Refuses a removed peer (``MESH_ERROR_REVOKED``), counted like :meth:`check`'s refusals."""
        try:
            self.revocations.check_node(peer_id)
        except MeshRefusal as refusal:
            self.revoked_refusals[refusal.code_name] = self.revoked_refusals.get(refusal.code_name, 0) + 1
            raise

    def _check(self, frame: mesh.GossipFrame, peer_id: bytes, admitted: bool, unix_now: float) -> Admission:
        self.revocations.check_node(peer_id)
        proof = frame.membership_proof if frame.HasField("membership_proof") else None
        if not admitted:
            verified = verify_membership_proof(
                proof,
                mesh_id=self.mesh_id,
                verifier_id=self.node_id,
                authenticated_peer_id=peer_id,
                unix_now=unix_now,
            )
            self.revocations.refuse_revoked(peer_id, verified)
            if proof is not None and verified.certificate is not None:
                self._remember(peer_id, proof.certificate, verified.certificate)
            return Admission(verified=verified)
        if proof is not None and proof.WhichOneof("credential") == "certificate":
            shown = proof.certificate.SerializeToString(deterministic=True)
            if self._certificate_bytes.get(peer_id) != shown:
                body = verify_certificate(
                    proof.certificate, mesh_id=self.mesh_id, node_id=peer_id, unix_now=unix_now
                )
                self._remember(peer_id, proof.certificate, body)
        held = self.certificates.get(peer_id)
        if held is not None:
            check_certificate_current(held, unix_now=unix_now)
        return Admission(verified=None)

    def _remember(
        self,
        peer_id: bytes,
        certificate: membership.MemberCertificate,
        body: membership.MemberCertificateBody,
    ) -> None:
        self.certificates[peer_id] = body
        self._certificate_bytes[peer_id] = certificate.SerializeToString(deterministic=True)

    def forget(self, peer_id: bytes) -> None:
        self.certificates.pop(peer_id, None)
        self._certificate_bytes.pop(peer_id, None)

    def grant_for(
        self,
        peer_id: bytes,
        admission: Admission,
        ours: MembershipState | None,
        *,
        unix_now: float,
    ) -> membership.MembershipGrant | None:
        """The grant an admin puts in its reply to ``peer_id``, or None (not an admin, nothing due)."""
        if ours is None or ours.mesh_key is None:
            return None
        verified = admission.verified
        promote = peer_id in self.pending_admins
        held = self.certificates.get(peer_id)
        due = held is not None and unix_now >= held.expires_unix - (held.expires_unix - held.issued_unix) / 2
        if not (promote or due or (verified is not None and verified.via_invite)):
            return None
        admin = promote or (held is not None and held.admin)
        certificate = issue_certificate(
            ours.mesh_key,
            node_id=peer_id,
            issuer_id=self.node_id,
            unix_now=unix_now,
            ttl_s=self.certificate_ttl_s,
            admin=admin,
        )
        self.pending_admins.discard(peer_id)
        return make_grant(certificate, admin_key=ours.mesh_key if admin else None)


REVOCATION_CODES = frozenset(
    {mesh.MESH_ERROR_REVOKED, mesh.MESH_ERROR_INVITE_REVOKED, mesh.MESH_ERROR_CERTIFICATE_EXPIRED}
)

__all__ = ["REVOCATION_CODES", "Admission", "CredentialGate"]
