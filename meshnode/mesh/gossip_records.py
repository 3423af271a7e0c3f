"""Open the signed records of one GossipFrame: keep the sound ones, drop the rest.

A bad record of some other node is dropped, not the frame: an honest sender
verified it, and may still relay what we refuse (our clock may be behind the
signer's, our version stricter), while its own record, and so its liveness, is
good. A bad
record of the sender itself refuses the frame (:meth:`OpenedGossip.sender_record`),
with the code that tells the sender what to fix. Pure and synchronous.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshnode.identity import short_id
from meshnode.mesh.signed_record import (
    RecordFault,
    RecordRejected,
    VerifiedRecord,
    decode_record,
    verify_record,
)
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

# The record a peer table already holds for a node (verified when it was merged).
HeldRecord = Callable[[bytes], mesh.SignedPeerRecord | None]


@dataclass(frozen=True)
class DroppedRecord:
    fault: RecordFault
    detail: str
    # The node the record claims to describe; None when it did not decode that far.
    node_id: bytes | None

    def __str__(self) -> str:
        named = short_id(self.node_id) if self.node_id is not None else "an unknown node"
        return f"record of {named}: {self.fault.value} ({self.detail})"


@dataclass(frozen=True)
class OpenedGossip:
    sender: bytes
    # Every sound record in the frame, the sender's own included.
    records: list[VerifiedRecord]
    dropped: list[DroppedRecord]

    def sender_record(self) -> VerifiedRecord:
        """The sender's own record, or the refusal of the whole frame."""
        for record in self.records:
            if record.node_id == self.sender:
                return record
        for drop in self.dropped:
            if drop.node_id == self.sender:
                raise RecordRejected(drop.fault, drop.detail, drop.node_id).refusal()
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "GossipFrame lacks the sender's own record")


def open_gossip_entries(
    entries: Iterable[mesh.GossipEntry], *, sender: bytes, mesh_id: str, unix_now: float, held: HeldRecord
) -> OpenedGossip:
    """Verify each entry's record against the node it names (incarnations against ``unix_now``).

    A record identical to the one ``held`` returns for its node was verified when
    it was merged and is not verified again: most of a frame repeats what we
    hold, and re-verifying it would cost one Ed25519 check per node per frame.
    """
    records: list[VerifiedRecord] = []
    dropped: list[DroppedRecord] = []
    seen: set[bytes] = set()
    for entry in entries:
        # A standalone copy: a sub-message kept in the peer table would keep the whole frame alive.
        signed = mesh.SignedPeerRecord(record=entry.record.record, signature=entry.record.signature)
        try:
            announcement = decode_record(signed)
        except RecordRejected as rejected:
            _check_once(rejected.node_id, seen)
            dropped.append(DroppedRecord(rejected.fault, rejected.detail, rejected.node_id))
            continue
        node_id = bytes(announcement.endpoint_id)
        _check_once(node_id, seen)
        try:
            if held(node_id) != signed:
                verify_record(signed, announcement, mesh_id=mesh_id, unix_now=unix_now)
        except RecordRejected as rejected:
            dropped.append(DroppedRecord(rejected.fault, rejected.detail, node_id))
            continue
        records.append(VerifiedRecord(announcement, signed))
    return OpenedGossip(sender=sender, records=records, dropped=dropped)


def _check_once(node_id: bytes | None, seen: set[bytes]) -> None:
    if node_id is None:
        return
    if node_id in seen:
        # No honest sender repeats a node: this is the sender's own malformation.
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "a node is announced twice in one frame")
    seen.add(node_id)


__all__ = ["DroppedRecord", "HeldRecord", "OpenedGossip", "open_gossip_entries"]
