"""Signed peer records: each node signs its own announcement; gossip relays it unchanged.

A member is authenticated, not trusted: the frame-level check (``sender_id`` is
the TLS identity) says nothing about the entries that describe other nodes, so
without signatures one member could rewrite any node's address, serving range
or freshness. As in libp2p's signed peer records and Ethereum's ENR (EIP-778),
what gossip says about a node is that node's own record, signed by its node key:

* the signer serializes its ``PeerAnnouncement`` once and signs
  ``RECORD_DOMAIN || bytes`` with its node key; the bytes and the signature
  travel unchanged (protobuf serialization is not canonical, so a verifier never
  re-encodes);
* a receiver decodes the bytes, verifies the signature against the record's own
  ``endpoint_id`` and only then believes anything in it;
* freshness (incarnation, heartbeat_seq) is inside the signed bytes, so it comes
  only from the signer; an incarnation (the unix time in nanoseconds its node
  started) further ahead of the receiver's wall clock than
  ``MAX_INCARNATION_AHEAD_NS`` is refused, so no record, not even a node's own
  written by a bug or a wrong clock, can outrank all its successors.

The mesh key plays no part: who may sign a node's record does not depend on who
holds the mesh key. Pure and synchronous; the receiver's wall-clock time is the
parameter ``unix_now`` (seconds), as where credentials are checked
(:mod:`meshnode.sansio`): incarnations are wall-clock instants of other machines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshnode.identity import NODE_ID_BYTES, NodeIdentity, short_id, verify_signature
from meshnode.mesh.validation import validate_announcement
from meshnode.sansio import SECOND_NS
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

# Everything else a node key signs begins otherwise: relay registration and the
# relay seal with their own NUL-terminated tags (no such tag is a prefix of
# another), the QUIC certificate with DER, TLS 1.3's CertificateVerify with 64
# spaces. So a node-key signature made for another purpose never verifies as a
# peer record, nor a record's signature as anything else.
RECORD_DOMAIN = b"meshnode/v1/peer-record\0"

# How far past the receiver's wall clock a record's incarnation may be. Nodes'
# clocks are NTP-close in practice; five minutes (Kerberos's default skew)
# tolerates a badly set clock, and bounds how long a record made by one can win
# over the node's next incarnation.
MAX_INCARNATION_AHEAD_NS = 300 * SECOND_NS


class RecordFault(enum.Enum):
    """Why a gossiped record was dropped; the value is the counter's reason label."""

    UNSIGNED = "unsigned"
    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad_signature"
    OTHER_MESH = "other_mesh"
    FUTURE_INCARNATION = "future_incarnation"


# The refusal a fault becomes when the record is the gossip sender's own.
_FAULT_CODES = {
    RecordFault.UNSIGNED: mesh.MESH_ERROR_FORGED,
    RecordFault.MALFORMED: mesh.MESH_ERROR_MALFORMED,
    RecordFault.BAD_SIGNATURE: mesh.MESH_ERROR_FORGED,
    RecordFault.OTHER_MESH: mesh.MESH_ERROR_OTHER_MESH,
    RecordFault.FUTURE_INCARNATION: mesh.MESH_ERROR_FUTURE_INCARNATION,
}


class RecordRejected(Exception):
    def __init__(self, fault: RecordFault, detail: str, node_id: bytes | None = None) -> None:
        self.fault = fault
        self.detail = detail
        # The node the record claims to describe, once known (None: it did not decode).
        self.node_id = node_id
        super().__init__(f"{fault.value}: {detail}")

    def refusal(self) -> MeshRefusal:
        return MeshRefusal(_FAULT_CODES[self.fault], f"the sender's own record: {self.detail}")


def signing_message(record: bytes) -> bytes:
    return RECORD_DOMAIN + record


def sign_record(identity: NodeIdentity, announcement: mesh.PeerAnnouncement) -> mesh.SignedPeerRecord:
    """``announcement`` as ``identity`` publishes it; it must name ``identity``."""
    return _sign(identity, announcement, announcement.SerializeToString(deterministic=True))


def _sign(
    identity: NodeIdentity, announcement: mesh.PeerAnnouncement, record: bytes
) -> mesh.SignedPeerRecord:
    if bytes(announcement.endpoint_id) != identity.node_id:
        raise ValueError("a node signs only its own record")
    return mesh.SignedPeerRecord(record=record, signature=identity.sign(signing_message(record)))


@dataclass(frozen=True)
class VerifiedRecord:
    """A record whose signature and contents were checked, and the announcement it holds."""

    announcement: mesh.PeerAnnouncement
    signed: mesh.SignedPeerRecord

    @property
    def node_id(self) -> bytes:
        return bytes(self.announcement.endpoint_id)


def decode_record(signed: mesh.SignedPeerRecord) -> mesh.PeerAnnouncement:
    """The announcement in ``signed``, not yet verified (its endpoint_id names the key to verify with)."""
    if not signed.signature:
        # Decode anyway, only to name the node in the drop.
        node_id = _best_effort_node_id(signed.record)
        raise RecordRejected(RecordFault.UNSIGNED, "the record carries no signature", node_id)
    try:
        announcement = mesh.PeerAnnouncement.FromString(signed.record)
    except DecodeError:
        raise RecordRejected(RecordFault.MALFORMED, "the record does not decode") from None
    if len(announcement.endpoint_id) != NODE_ID_BYTES:
        raise RecordRejected(RecordFault.MALFORMED, "the record's endpoint_id is not a node id")
    return announcement


def verify_record(
    signed: mesh.SignedPeerRecord, announcement: mesh.PeerAnnouncement, *, mesh_id: str, unix_now: float
) -> None:
    """Raise :class:`RecordRejected` unless ``announcement`` (decoded from ``signed``) is sound.

    The signature is checked first: nothing in an unauthenticated record is
    worth validating, and a fault reported for it would describe the forger.
    """
    node_id = bytes(announcement.endpoint_id)
    if not verify_signature(node_id, bytes(signed.signature), signing_message(bytes(signed.record))):
        raise RecordRejected(
            RecordFault.BAD_SIGNATURE, f"not signed by {short_id(node_id)}, the node it names", node_id
        )
    try:
        validate_announcement(announcement)
    except MeshRefusal as refusal:
        raise RecordRejected(RecordFault.MALFORMED, refusal.detail, node_id) from None
    if announcement.mesh_id != mesh_id:
        raise RecordRejected(RecordFault.OTHER_MESH, "the record names another mesh", node_id)
    ahead_ns = announcement.incarnation - int(unix_now * SECOND_NS)
    if ahead_ns > MAX_INCARNATION_AHEAD_NS:
        raise RecordRejected(
            RecordFault.FUTURE_INCARNATION,
            f"incarnation {ahead_ns / SECOND_NS:.0f} s ahead of our clock "
            f"(at most {MAX_INCARNATION_AHEAD_NS // SECOND_NS} s); check that node's clock",
            node_id,
        )


def open_record(signed: mesh.SignedPeerRecord, *, mesh_id: str, unix_now: float) -> VerifiedRecord:
    """Decode and verify ``signed``, or raise :class:`RecordRejected`."""
    announcement = decode_record(signed)
    verify_record(signed, announcement, mesh_id=mesh_id, unix_now=unix_now)
    return VerifiedRecord(announcement, signed)


def _best_effort_node_id(record: bytes) -> bytes | None:
    try:
        node_id = bytes(mesh.PeerAnnouncement.FromString(record).endpoint_id)
    except DecodeError:
        return None
    return node_id if len(node_id) == NODE_ID_BYTES else None


@dataclass
class LocalRecord:
    """This node's signed record, re-signed only when its announcement's bytes change."""

    identity: NodeIdentity
    _signed: mesh.SignedPeerRecord | None = None

    def signed(self, announcement: mesh.PeerAnnouncement) -> mesh.SignedPeerRecord:
        record = announcement.SerializeToString(deterministic=True)
        if self._signed is None or self._signed.record != record:
            self._signed = _sign(self.identity, announcement, record)
        return self._signed


__all__ = [
    "MAX_INCARNATION_AHEAD_NS",
    "RECORD_DOMAIN",
    "LocalRecord",
    "RecordFault",
    "RecordRejected",
    "VerifiedRecord",
    "decode_record",
    "open_record",
    "sign_record",
    "signing_message",
    "verify_record",
]
