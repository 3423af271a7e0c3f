"""Mesh keys, invites, member certificates and membership proofs. Pure functions.

Trust model (``proto/meshnode/v1/membership.proto`` has the wire details; the
README's "Trust model" section says it for users):

* A mesh is one Ed25519 *mesh key*; the mesh id is derived from its public key,
  so any credential can be checked against the mesh id alone.
* Only *admins* hold the mesh key: the node that created the mesh, and the nodes
  an admin promotes (``meshnode admin grant NODE``, delivered in a
  :class:`MembershipGrant` over the mutually authenticated link). Everything the
  mesh trusts is signed by it: invites, certificates and revocations
  (:mod:`meshnode.membership.revocation`). A plain member holds no key, so
  nothing it signs is accepted: it cannot invite, admit by invite, renew or remove.
* An invite is signed by the mesh key and carries a fresh invite key pair; the
  private half travels in the token and is the bearer secret.
* A joiner proves possession by signing (mesh, its own node id, the verifier's
  node id) with the invite key. The transport authenticates the joiner's node id,
  so a captured proof is useless to any other identity or against another verifier.
* An admitting admin answers with a :class:`MembershipGrant`: a member
  certificate (mesh-key-signed node id, an expiry, the admin flag). Members show
  their certificate on every gossip frame; it is refused once expired
  (``MESH_ERROR_CERTIFICATE_EXPIRED``), so an admin renews it (a fresh grant in a
  gossip reply) while the member is online and not revoked. An expired
  certificate is never renewed: the member needs a new invite.

Every check raises :class:`~meshnode.wire.mesh_refusal.MeshRefusal` with the exact
code. Time is a parameter, ``unix_now``: wall-clock seconds, because what it is
compared with (an invite's ``expires_unix``) and stamped into (``issued_unix``) are
wall-clock instants every member reads alike (:mod:`meshnode.sansio`). Nothing here logs; secrets are wrapped
in objects whose ``repr`` does not show them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import (
    NODE_ID_BYTES,
    SIGNATURE_BYTES,
    private_key_seed,
    public_key_bytes,
    short_id,
    verify_signature,
)
from meshnode.transport.addresses import is_valid_address
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

MESH_ID_TAG = b"meshnode/v1/mesh-id\0"
INVITE_BODY_TAG = b"meshnode/v1/invite-body\0"
POSSESSION_TAG = b"meshnode/v1/invite-possession\0"
CERTIFICATE_TAG = b"meshnode/v1/member-certificate\0"

TOKEN_VERSION = 1
MAX_TOKEN_CHARS = 16 * 1024
MAX_ENDPOINTS = 16
DEFAULT_INVITE_TTL_S = 24 * 3600
# An invite admits whoever holds it, as often as they like, until it expires: a month at most.
MAX_INVITE_TTL_S = 30 * 24 * 3600
DEFAULT_CERTIFICATE_TTL_S = 24 * 3600

MALFORMED = mesh.MESH_ERROR_MALFORMED
FORGED = mesh.MESH_ERROR_FORGED
EXPIRED = mesh.MESH_ERROR_INVITE_EXPIRED
OTHER_MESH = mesh.MESH_ERROR_OTHER_MESH
WRONG_IDENTITY = mesh.MESH_ERROR_WRONG_IDENTITY
NO_CREDENTIAL = mesh.MESH_ERROR_NO_CREDENTIAL
CERTIFICATE_EXPIRED = mesh.MESH_ERROR_CERTIFICATE_EXPIRED


def mesh_id_from_public_key(mesh_public_key: bytes) -> str:
    digest = hashlib.sha256(MESH_ID_TAG + mesh_public_key).digest()[:16]
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


MESH_ID_CHARS = 26  # base32 of a 16-byte digest, unpadded


def is_mesh_id(text: str) -> bool:
    """Whether ``text`` has the form of a mesh id (it may still name no mesh)."""
    return len(text) == MESH_ID_CHARS and all(c in "abcdefghijklmnopqrstuvwxyz234567" for c in text)


class MeshKey:
    """The mesh signing key. Secret: its ``repr`` shows only the mesh id."""

    __slots__ = ("_key", "mesh_id", "public_key")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_key = public_key_bytes(key)
        self.mesh_id = mesh_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> MeshKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> MeshKey:
        if len(seed) != 32:
            raise MeshRefusal(MALFORMED, "mesh key must be 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def seed(self) -> bytes:
        return private_key_seed(self._key)

    def sign(self, tag: bytes, body: bytes) -> bytes:
        return self._key.sign(tag + body)

    def __repr__(self) -> str:
        return f"MeshKey(mesh_id={self.mesh_id})"


@dataclass(frozen=True)
class Endpoint:
    """A peer or relay pinned by its 32-byte identity key."""

    id: bytes
    address: str

    def to_pb(self) -> membership.PinnedEndpoint:
        return membership.PinnedEndpoint(id=self.id, address=self.address)

    @classmethod
    def from_pb(cls, pb: membership.PinnedEndpoint) -> Endpoint:
        return cls(id=bytes(pb.id), address=pb.address)

    def __str__(self) -> str:
        return f"{short_id(self.id)}@{self.address}"


@dataclass(frozen=True, repr=False)
class Invite:
    """A decoded invite token. Holds the invite private key: do not log it."""

    body: membership.InviteBody
    body_bytes: bytes
    body_signature: bytes
    invite_key: Ed25519PrivateKey

    @property
    def mesh_id(self) -> str:
        return mesh_id_from_public_key(self.body.mesh_public_key)

    @property
    def expires_unix(self) -> int:
        return self.body.expires_unix

    @property
    def issuer_id(self) -> bytes:
        return bytes(self.body.issuer_id)

    @property
    def invite_id(self) -> bytes:
        """The invite's public key: how ``meshnode invite --list`` and a revocation name it."""
        return bytes(self.body.invite_public_key)

    @property
    def bootstrap(self) -> list[Endpoint]:
        return [Endpoint.from_pb(e) for e in self.body.bootstrap]

    @property
    def relays(self) -> list[Endpoint]:
        return [Endpoint.from_pb(e) for e in self.body.relays]

    def __repr__(self) -> str:
        return (
            f"Invite(mesh_id={self.mesh_id}, issuer={short_id(self.issuer_id)}, expires={self.expires_unix})"
        )


@dataclass(frozen=True)
class VerifiedMembership:
    """What a verified proof established about the peer."""

    via_invite: bool
    mesh_public_key: bytes
    issuer_id: bytes
    # The invite's id (its public key) when admitted by invite, else b"".
    invite_public_key: bytes = b""
    # The certificate presented, when admitted by certificate.
    certificate: membership.MemberCertificateBody | None = None


def create_invite(
    mesh_key: MeshKey,
    *,
    issuer_id: bytes,
    bootstrap: list[Endpoint],
    relays: list[Endpoint] | None = None,
    ttl_s: float = DEFAULT_INVITE_TTL_S,
    unix_now: float,
) -> Invite:
    if not bootstrap:
        raise ValueError("an invite needs at least one bootstrap peer")
    if not 0 < ttl_s <= MAX_INVITE_TTL_S:
        raise ValueError(f"invite ttl must be positive and at most {MAX_INVITE_TTL_S // 86400} days")
    invite_key = Ed25519PrivateKey.generate()
    body = membership.InviteBody(
        mesh_public_key=mesh_key.public_key,
        bootstrap=[e.to_pb() for e in bootstrap[:MAX_ENDPOINTS]],
        relays=[e.to_pb() for e in (relays or [])[:MAX_ENDPOINTS]],
        issued_unix=int(unix_now),
        expires_unix=int(unix_now + ttl_s),
        invite_public_key=public_key_bytes(invite_key),
        issuer_id=issuer_id,
    )
    body_bytes = body.SerializeToString(deterministic=True)
    return Invite(
        body=body,
        body_bytes=body_bytes,
        body_signature=mesh_key.sign(INVITE_BODY_TAG, body_bytes),
        invite_key=invite_key,
    )


def encode_invite_token(invite: Invite) -> str:
    token = membership.InviteToken(
        version=TOKEN_VERSION,
        body=invite.body_bytes,
        body_signature=invite.body_signature,
        invite_private_key=private_key_seed(invite.invite_key),
    )
    return base64.urlsafe_b64encode(token.SerializeToString(deterministic=True)).decode("ascii").rstrip("=")


def _parse_invite_body(body_bytes: bytes) -> membership.InviteBody:
    try:
        body = membership.InviteBody.FromString(body_bytes)
    except DecodeError:
        raise MeshRefusal(MALFORMED, "invite body does not decode") from None
    if len(body.mesh_public_key) != NODE_ID_BYTES or len(body.invite_public_key) != NODE_ID_BYTES:
        raise MeshRefusal(MALFORMED, "invite keys must be 32 bytes")
    if len(body.issuer_id) != NODE_ID_BYTES:
        raise MeshRefusal(MALFORMED, "invite issuer id must be 32 bytes")
    if len(body.bootstrap) > MAX_ENDPOINTS or len(body.relays) > MAX_ENDPOINTS:
        raise MeshRefusal(MALFORMED, "invite lists too many endpoints")
    for endpoint in [*body.bootstrap, *body.relays]:
        if len(endpoint.id) != NODE_ID_BYTES or not is_valid_address(endpoint.address):
            raise MeshRefusal(MALFORMED, "invite endpoint needs a 32-byte id and a host:port address")
    return body


def decode_invite_token(text: str) -> Invite:
    """Parse a token; checks structure only (see :func:`check_invite`)."""
    text = "".join(text.split())
    if not text:
        raise MeshRefusal(MALFORMED, "empty invite token")
    if len(text) > MAX_TOKEN_CHARS:
        raise MeshRefusal(MALFORMED, "invite token too long")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise MeshRefusal(MALFORMED, "invite token is not base64url") from None
    try:
        token = membership.InviteToken.FromString(raw)
    except DecodeError:
        raise MeshRefusal(MALFORMED, "invite token does not decode") from None
    if token.version != TOKEN_VERSION:
        raise MeshRefusal(MALFORMED, f"unsupported invite token version {token.version}")
    body = _parse_invite_body(token.body)
    if len(token.body_signature) != SIGNATURE_BYTES or len(token.invite_private_key) != 32:
        raise MeshRefusal(MALFORMED, "invite signature or key has the wrong size")
    invite_key = Ed25519PrivateKey.from_private_bytes(token.invite_private_key)
    if public_key_bytes(invite_key) != body.invite_public_key:
        raise MeshRefusal(FORGED, "invite secret does not match the signed invite")
    if not body.bootstrap:
        raise MeshRefusal(MALFORMED, "invite has no bootstrap peers")
    return Invite(
        body=body,
        body_bytes=bytes(token.body),
        body_signature=bytes(token.body_signature),
        invite_key=invite_key,
    )


def _check_signed_invite(
    body: membership.InviteBody, body_bytes: bytes, signature: bytes, unix_now: float
) -> None:
    if not verify_signature(bytes(body.mesh_public_key), signature, INVITE_BODY_TAG + body_bytes):
        raise MeshRefusal(FORGED, "invite signature does not verify")
    if unix_now >= body.expires_unix:
        raise MeshRefusal(EXPIRED, f"invite expired at unix time {body.expires_unix}")


def check_invite(invite: Invite, *, unix_now: float) -> None:
    """What a joiner can check before dialing: the mesh signature and the expiry."""
    _check_signed_invite(invite.body, invite.body_bytes, invite.body_signature, unix_now)


def possession_message(mesh_public_key: bytes, joiner_id: bytes, verifier_id: bytes) -> bytes:
    return POSSESSION_TAG + mesh_public_key + joiner_id + verifier_id


def make_invite_proof(invite: Invite, *, joiner_id: bytes, verifier_id: bytes) -> membership.MembershipProof:
    signature = invite.invite_key.sign(
        possession_message(invite.body.mesh_public_key, joiner_id, verifier_id)
    )
    return membership.MembershipProof(
        invite=membership.InviteProof(
            body=invite.body_bytes, body_signature=invite.body_signature, possession_signature=signature
        )
    )


def issue_certificate(
    mesh_key: MeshKey,
    *,
    node_id: bytes,
    issuer_id: bytes,
    unix_now: float,
    ttl_s: float = DEFAULT_CERTIFICATE_TTL_S,
    admin: bool = False,
) -> membership.MemberCertificate:
    if ttl_s <= 0:
        raise ValueError("certificate ttl must be positive")
    body = membership.MemberCertificateBody(
        mesh_public_key=mesh_key.public_key,
        node_id=node_id,
        issued_unix=int(unix_now),
        issuer_id=issuer_id,
        # At least one second: int() of a short test ttl must not make it expire as issued.
        expires_unix=int(unix_now) + max(1, round(ttl_s)),
        admin=admin,
    )
    body_bytes = body.SerializeToString(deterministic=True)
    return membership.MemberCertificate(body=body_bytes, signature=mesh_key.sign(CERTIFICATE_TAG, body_bytes))


def certificate_proof(certificate: membership.MemberCertificate) -> membership.MembershipProof:
    proof = membership.MembershipProof()
    proof.certificate.CopyFrom(certificate)
    return proof


def decode_certificate_body(certificate: membership.MemberCertificate) -> membership.MemberCertificateBody:
    """The body, decoded but not verified (for showing our own certificate's expiry)."""
    try:
        return membership.MemberCertificateBody.FromString(certificate.body)
    except DecodeError:
        raise MeshRefusal(MALFORMED, "member certificate does not decode") from None


def check_certificate_current(body: membership.MemberCertificateBody, *, unix_now: float) -> None:
    if unix_now >= body.expires_unix:
        raise MeshRefusal(
            CERTIFICATE_EXPIRED, f"member certificate expired at unix time {body.expires_unix} (not renewed)"
        )


def verify_certificate(
    certificate: membership.MemberCertificate,
    *,
    mesh_id: str,
    node_id: bytes,
    unix_now: float | None = None,
) -> membership.MemberCertificateBody:
    """Signature, mesh and holder; with ``unix_now``, the expiry too (a data directory is loaded
    without it, so that its node starts and is told by its peers, or sees for itself, that it expired)."""
    try:
        body = membership.MemberCertificateBody.FromString(certificate.body)
    except DecodeError:
        raise MeshRefusal(MALFORMED, "member certificate does not decode") from None
    if len(body.mesh_public_key) != NODE_ID_BYTES or len(body.node_id) != NODE_ID_BYTES:
        raise MeshRefusal(MALFORMED, "member certificate ids must be 32 bytes")
    if not verify_signature(
        bytes(body.mesh_public_key), certificate.signature, CERTIFICATE_TAG + certificate.body
    ):
        raise MeshRefusal(FORGED, "member certificate signature does not verify")
    if mesh_id_from_public_key(body.mesh_public_key) != mesh_id:
        raise MeshRefusal(OTHER_MESH, "member certificate is for another mesh")
    if body.node_id != node_id:
        raise MeshRefusal(WRONG_IDENTITY, "member certificate names another node")
    if body.expires_unix <= 0:
        raise MeshRefusal(MALFORMED, "member certificate has no expiry")
    if unix_now is not None:
        check_certificate_current(body, unix_now=unix_now)
    return body


def verify_membership_proof(
    proof: membership.MembershipProof | None,
    *,
    mesh_id: str,
    verifier_id: bytes,
    authenticated_peer_id: bytes,
    unix_now: float,
) -> VerifiedMembership:
    """Check that the authenticated peer may be admitted to ``mesh_id`` by ``verifier_id``.

    Reusable by anything that admits members (the node, a relay): it needs only
    the mesh id, its own id and the transport-authenticated peer id.
    """
    kind = proof.WhichOneof("credential") if proof is not None else None
    if proof is None or kind is None:
        raise MeshRefusal(NO_CREDENTIAL)
    if kind == "certificate":
        body = verify_certificate(
            proof.certificate, mesh_id=mesh_id, node_id=authenticated_peer_id, unix_now=unix_now
        )
        return VerifiedMembership(
            via_invite=False,
            mesh_public_key=bytes(body.mesh_public_key),
            issuer_id=bytes(body.issuer_id),
            certificate=body,
        )
    invite_proof = proof.invite
    body = _parse_invite_body(invite_proof.body)
    _check_signed_invite(body, invite_proof.body, invite_proof.body_signature, unix_now)
    if mesh_id_from_public_key(body.mesh_public_key) != mesh_id:
        raise MeshRefusal(OTHER_MESH, "invite is for another mesh")
    message = possession_message(body.mesh_public_key, authenticated_peer_id, verifier_id)
    if not verify_signature(bytes(body.invite_public_key), invite_proof.possession_signature, message):
        raise MeshRefusal(FORGED, "invite possession proof does not verify for this joiner and verifier")
    return VerifiedMembership(
        via_invite=True,
        mesh_public_key=bytes(body.mesh_public_key),
        issuer_id=bytes(body.issuer_id),
        invite_public_key=bytes(body.invite_public_key),
    )


def make_grant(
    certificate: membership.MemberCertificate, *, admin_key: MeshKey | None = None
) -> membership.MembershipGrant:
    """A certificate for the peer; the mesh key only with ``admin_key`` (a promotion to admin)."""
    grant = membership.MembershipGrant(certificate=certificate)
    if admin_key is not None:
        grant.mesh_private_key = admin_key.seed()
    return grant


def open_grant(
    grant: membership.MembershipGrant, *, mesh_id: str, node_id: bytes, unix_now: float
) -> tuple[MeshKey | None, membership.MemberCertificate]:
    """Check a grant received from an admin: a current certificate for us, and the mesh key if any."""
    mesh_key: MeshKey | None = None
    if grant.mesh_private_key:
        if len(grant.mesh_private_key) != 32:
            raise MeshRefusal(MALFORMED, "granted mesh key must be 32 bytes")
        mesh_key = MeshKey.from_seed(bytes(grant.mesh_private_key))
        if mesh_key.mesh_id != mesh_id:
            raise MeshRefusal(OTHER_MESH, "granted mesh key is for another mesh")
    verify_certificate(grant.certificate, mesh_id=mesh_id, node_id=node_id, unix_now=unix_now)
    return mesh_key, grant.certificate


__all__ = [
    "DEFAULT_CERTIFICATE_TTL_S",
    "DEFAULT_INVITE_TTL_S",
    "MAX_INVITE_TTL_S",
    "MESH_ID_CHARS",
    "Endpoint",
    "Invite",
    "MeshKey",
    "VerifiedMembership",
    "certificate_proof",
    "check_certificate_current",
    "check_invite",
    "create_invite",
    "decode_certificate_body",
    "decode_invite_token",
    "encode_invite_token",
    "is_mesh_id",
    "issue_certificate",
    "make_grant",
    "make_invite_proof",
    "mesh_id_from_public_key",
    "open_grant",
    "verify_certificate",
    "verify_membership_proof",
]
