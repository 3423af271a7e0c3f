"""What a member keeps in its data directory, and the data directory lock.

Layout (all files 0600, the directory 0700)::

    node_key.pem        node identity (meshnode.identity)
    mesh_key            32-byte mesh key seed (secret; admins only)
    membership.json     mesh id, member certificate, last known peers and relays
    revocations.pb      the admin-signed revocations this node knows (RevocationSet)
    evidence.pb         the audit evidence reports it kept and the mesh policy (KeptEvidence)
    invites.json        the invites this admin issued, and who used them
    control.sock        loopback status socket of the running node
    node.lock           held by the running node
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import ensure_private_dir, read_private_file, write_private_file
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    decode_certificate_body,
    mesh_id_from_public_key,
    verify_certificate,
)

MESH_KEY_FILE = "mesh_key"
MEMBERSHIP_FILE = "membership.json"
REVOCATIONS_FILE = "revocations.pb"
EVIDENCE_FILE = "evidence.pb"
# Kept reports (64 at most, ~11 KiB each at most) and a policy fit with room; a larger file is not read.
MAX_EVIDENCE_FILE_BYTES = 1 << 20
CONTROL_SOCKET = "control.sock"
LOCK_FILE = "node.lock"
MAX_KNOWN_PEERS = 64


class StoreError(Exception):
    pass


@dataclass(repr=False)
class MembershipState:
    # Admins only (the creator and the nodes it promoted); None on a plain member.
    mesh_key: MeshKey | None
    certificate: membership.MemberCertificate
    known_peers: list[Endpoint] = field(default_factory=list)
    relays: list[Endpoint] = field(default_factory=list)

    @property
    def certificate_body(self) -> membership.MemberCertificateBody:
        return decode_certificate_body(self.certificate)

    @property
    def mesh_id(self) -> str:
        return mesh_id_from_public_key(bytes(self.certificate_body.mesh_public_key))

    @property
    def is_admin(self) -> bool:
        return self.mesh_key is not None

    def certificate_expired(self, unix_now: float) -> bool:
        return unix_now >= self.certificate_body.expires_unix

    def __repr__(self) -> str:
        return f"MembershipState(mesh_id={self.mesh_id}, known_peers={len(self.known_peers)})"


def _endpoints_to_json(endpoints: list[Endpoint]) -> list[dict[str, str]]:
    return [{"id": e.id.hex(), "address": e.address} for e in endpoints]


def _endpoints_from_json(items: list[dict[str, str]]) -> list[Endpoint]:
    return [Endpoint(id=bytes.fromhex(item["id"]), address=item["address"]) for item in items]


class DataDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_fd: int | None = None

    @property
    def control_socket(self) -> Path:
        return self.path / CONTROL_SOCKET

    def has_membership(self) -> bool:
        return (self.path / MEMBERSHIP_FILE).exists()

    def has_mesh_key(self) -> bool:
        return (self.path / MESH_KEY_FILE).exists()

    def load_membership(self, node_id: bytes) -> MembershipState:
        """The stored membership, checked: the certificate must be ours and match the mesh key."""
        try:
            data = json.loads(read_private_file(self.path / MEMBERSHIP_FILE))
            certificate = membership.MemberCertificate.FromString(base64.b64decode(data["certificate"]))
            mesh_id = mesh_id_from_public_key(bytes(decode_certificate_body(certificate).mesh_public_key))
            mesh_key = self._load_mesh_key()
            known = _endpoints_from_json(data.get("known_peers", []))
            relays = _endpoints_from_json(data.get("relays", []))
        except FileNotFoundError:
            raise StoreError(
                f"{self.path} holds no mesh membership (run `meshnode create` or `join`)"
            ) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"membership state in {self.path} is corrupt: {type(exc).__name__}") from None
        if data.get("mesh_id") != mesh_id or (mesh_key is not None and mesh_key.mesh_id != mesh_id):
            raise StoreError(f"membership state in {self.path} does not match its mesh key")
        # No expiry check here: an expired member still starts, and exits saying so (Node).
        verify_certificate(certificate, mesh_id=mesh_id, node_id=node_id)
        return MembershipState(mesh_key=mesh_key, certificate=certificate, known_peers=known, relays=relays)

    def _load_mesh_key(self) -> MeshKey | None:
        try:
            return MeshKey.from_seed(read_private_file(self.path / MESH_KEY_FILE))
        except FileNotFoundError:
            return None  # a plain member

    def save_membership(self, state: MembershipState) -> None:
        if state.mesh_key is not None:
            write_private_file(self.path / MESH_KEY_FILE, state.mesh_key.seed())
        self.save_peers(state)

    def load_revocations(self) -> list[membership.Revocation]:
        """The stored revocations, unverified (the caller's RevocationList verifies them)."""
        try:
            raw = read_private_file(self.path / REVOCATIONS_FILE)
        except FileNotFoundError:
            return []
        try:
            return list(membership.RevocationSet.FromString(raw).revocations)
        except DecodeError:
            raise StoreError(f"revocations in {self.path} are corrupt") from None

    def save_revocations(self, revocations: list[membership.Revocation]) -> None:
        data = membership.RevocationSet(revocations=revocations).SerializeToString(deterministic=True)
        write_private_file(self.path / REVOCATIONS_FILE, data)

    def load_evidence(self) -> audit.KeptEvidence:
        """The stored evidence reports and mesh policy, unverified (the node verifies them again)."""
        try:
            raw = read_private_file(self.path / EVIDENCE_FILE)
        except FileNotFoundError:
            return audit.KeptEvidence()
        if len(raw) > MAX_EVIDENCE_FILE_BYTES:
            raise StoreError(f"evidence in {self.path} is over {MAX_EVIDENCE_FILE_BYTES} bytes")
        try:
            return audit.KeptEvidence.FromString(raw)
        except DecodeError:
            raise StoreError(f"evidence in {self.path} is corrupt") from None

    def save_evidence(self, kept: audit.KeptEvidence) -> None:
        write_private_file(self.path / EVIDENCE_FILE, kept.SerializeToString(deterministic=True))

    def save_peers(self, state: MembershipState) -> None:
        data = {
            "mesh_id": state.mesh_id,
            "certificate": base64.b64encode(state.certificate.SerializeToString()).decode("ascii"),
            "known_peers": _endpoints_to_json(state.known_peers[:MAX_KNOWN_PEERS]),
            "relays": _endpoints_to_json(state.relays),
        }
        write_private_file(self.path / MEMBERSHIP_FILE, json.dumps(data, indent=1).encode())

    def lock(self) -> None:
        """Take the data directory for this process; refuses a second node on the same directory."""
        ensure_private_dir(self.path)
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"another meshnode is running on {self.path}") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(self.path / LOCK_FILE)) from exc
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


__all__ = ["DataDir", "MembershipState", "StoreError"]
