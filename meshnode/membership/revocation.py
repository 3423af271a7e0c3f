"""Admin-signed revocations of members and invites, and the list every node and relay keeps. Pure.

A :class:`Revocation` is the mesh key's signature over a ``RevocationBody``
naming one node id or one invite (its public key) with a reason. Only admins
hold the mesh key, so only an admin can remove; the signature lets any holder
of the mesh id check a revocation it was handed by anybody, which is why it can
travel on every gossip frame, to relays and through refusals, and why a removed
node believes the revocation it is shown rather than a bare refusal code.

Revocations are permanent: nothing un-revokes a node id (a removed machine gets
a new identity and a new invite). :class:`RevocationList` holds the verified
ones of one mesh, bounded by :data:`MAX_REVOCATIONS`, and answers the checks
made on link admission, certificates, gossip records, sessions and relay
registration (:meth:`RevocationList.refuse_revoked`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NODE_ID_BYTES, short_id, verify_signature
from meshnode.membership.credentials import MeshKey, VerifiedMembership, mesh_id_from_public_key
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

REVOCATION_TAG = b"meshnode/v1/revocation\0"
MAX_REASON_CHARS = 200
# A mesh removing more members than this has a bigger problem than a list: it should start anew.
MAX_REVOCATIONS = 4096
# Signature checks one batch (a gossip frame) may cost: a member flooding forged revocations gets
# this many Ed25519 verifications per frame, not thousands; a genuine backlog arrives over a few frames.
MAX_NEW_PER_BATCH = 64

REVOKED = mesh.MESH_ERROR_REVOKED
INVITE_REVOKED = mesh.MESH_ERROR_INVITE_REVOKED


@dataclass(frozen=True)
class Revoked:
    """A verified revocation: what it names, why, by whom and when."""

    kind: str  # "node" or "invite"
    target: bytes
    reason: str
    issuer_id: bytes
    issued_unix: int
    signed: membership.Revocation

    def describe(self) -> str:
        what = "node" if self.kind == "node" else "invite"
        because = f": {self.reason}" if self.reason else ""
        return f"{what} {short_id(self.target)} revoked by admin {short_id(self.issuer_id)}{because}"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "id": self.target.hex(),
            "short_id": short_id(self.target),
            "reason": self.reason,
            "by": short_id(self.issuer_id),
            "issued_unix": self.issued_unix,
        }


def _sign(mesh_key: MeshKey, body: membership.RevocationBody) -> membership.Revocation:
    body_bytes = body.SerializeToString(deterministic=True)
    return membership.Revocation(body=body_bytes, signature=mesh_key.sign(REVOCATION_TAG, body_bytes))


def _body(mesh_key: MeshKey, reason: str, issuer_id: bytes, unix_now: float) -> membership.RevocationBody:
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"a revocation reason is at most {MAX_REASON_CHARS} characters")
    return membership.RevocationBody(
        mesh_public_key=mesh_key.public_key, reason=reason, issued_unix=int(unix_now), issuer_id=issuer_id
    )


def revoke_node(
    mesh_key: MeshKey, *, node_id: bytes, reason: str, issuer_id: bytes, unix_now: float
) -> membership.Revocation:
    if len(node_id) != NODE_ID_BYTES:
        raise ValueError("a node id is 32 bytes")
    body = _body(mesh_key, reason, issuer_id, unix_now)
    body.node_id = node_id
    return _sign(mesh_key, body)


def revoke_invite(
    mesh_key: MeshKey, *, invite_id: bytes, reason: str, issuer_id: bytes, unix_now: float
) -> membership.Revocation:
    if len(invite_id) != NODE_ID_BYTES:
        raise ValueError("an invite id is 32 bytes")
    body = _body(mesh_key, reason, issuer_id, unix_now)
    body.invite_public_key = invite_id
    return _sign(mesh_key, body)


def verify_revocation(revocation: membership.Revocation, *, mesh_id: str) -> Revoked:
    """Decode and verify one revocation for ``mesh_id``; refuses with the exact code."""
    try:
        body = membership.RevocationBody.FromString(revocation.body)
    except DecodeError:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "revocation does not decode") from None
    if len(body.mesh_public_key) != NODE_ID_BYTES or len(body.issuer_id) != NODE_ID_BYTES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "revocation keys must be 32 bytes")
    kind = body.WhichOneof("target")
    target = bytes(body.node_id) if kind == "node_id" else bytes(body.invite_public_key)
    if kind is None or len(target) != NODE_ID_BYTES:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "revocation names no 32-byte node or invite")
    if len(body.reason) > MAX_REASON_CHARS:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "revocation reason too long")
    if not verify_signature(
        bytes(body.mesh_public_key), revocation.signature, REVOCATION_TAG + revocation.body
    ):
        raise MeshRefusal(mesh.MESH_ERROR_FORGED, "revocation signature does not verify")
    if mesh_id_from_public_key(bytes(body.mesh_public_key)) != mesh_id:
        raise MeshRefusal(mesh.MESH_ERROR_OTHER_MESH, "revocation is for another mesh")
    return Revoked(
        kind="node" if kind == "node_id" else "invite",
        target=target,
        reason=body.reason,
        issuer_id=bytes(body.issuer_id),
        issued_unix=body.issued_unix,
        signed=membership.Revocation(body=revocation.body, signature=revocation.signature),
    )


@dataclass(frozen=True)
class Learned:
    """What :meth:`RevocationList.learn` took from a batch: the new ones, and how many it refused."""

    new: list[Revoked]
    refused: int


class RevocationList:
    """The verified revocations of one mesh, by target."""

    def __init__(self, mesh_id: str, *, max_revocations: int = MAX_REVOCATIONS) -> None:
        self.mesh_id = mesh_id
        self.max_revocations = max_revocations
        self._nodes: dict[bytes, Revoked] = {}
        self._invites: dict[bytes, Revoked] = {}
        # Exact bytes already verified: a frame repeating what we hold costs no signature check.
        self._seen: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._nodes) + len(self._invites)

    def learn(self, revocations: Iterable[membership.Revocation]) -> Learned:
        """Verify and keep the ones not held yet; a bad one is refused and counted, not raised
        (one forged entry must not hide the good ones beside it)."""
        new: list[Revoked] = []
        refused = checked = 0
        for revocation in revocations:
            key = revocation.body + revocation.signature
            if key in self._seen:
                continue
            checked += 1
            if checked > MAX_NEW_PER_BATCH:
                break  # the rest come again on the sender's next frame
            try:
                revoked = verify_revocation(revocation, mesh_id=self.mesh_id)
            except MeshRefusal:
                refused += 1
                continue
            table = self._nodes if revoked.kind == "node" else self._invites
            if revoked.target in table:
                self._seen.add(key)  # another admin's revocation of the same target: the first stands
                continue
            if len(self) >= self.max_revocations:
                refused += 1
                continue
            self._seen.add(key)
            table[revoked.target] = revoked
            new.append(revoked)
        return Learned(new=new, refused=refused)

    def node(self, node_id: bytes) -> Revoked | None:
        return self._nodes.get(node_id)

    def invite(self, invite_id: bytes) -> Revoked | None:
        return self._invites.get(invite_id)

    def all(self) -> list[Revoked]:
        return sorted([*self._nodes.values(), *self._invites.values()], key=lambda r: r.issued_unix)

    def signed(self) -> list[membership.Revocation]:
        return [revoked.signed for revoked in self.all()]

    def check_node(self, node_id: bytes) -> None:
        """Refuses a revoked node with ``MESH_ERROR_REVOKED``."""
        revoked = self._nodes.get(node_id)
        if revoked is not None:
            raise MeshRefusal(REVOKED, revoked.describe())

    def refuse_revoked(self, peer_id: bytes, verified: VerifiedMembership) -> None:
        """After a proof verified: the node (``REVOKED``) or the invite it used (``INVITE_REVOKED``)."""
        self.check_node(peer_id)
        if verified.via_invite:
            revoked = self._invites.get(verified.invite_public_key)
            if revoked is not None:
                raise MeshRefusal(INVITE_REVOKED, revoked.describe())


__all__ = [
    "INVITE_REVOKED",
    "MAX_NEW_PER_BATCH",
    "MAX_REASON_CHARS",
    "MAX_REVOCATIONS",
    "REVOKED",
    "Learned",
    "RevocationList",
    "Revoked",
    "revoke_invite",
    "revoke_node",
    "verify_revocation",
]
