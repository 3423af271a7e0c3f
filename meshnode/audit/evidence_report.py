"""Evidence reports: a head's conviction, signed by the head, as gossip carries it. Pure.

A head whose audit convicted a node wraps the evidence in an ``EvidenceReport``: the body
(reporter, mesh, time, evidence) serialized once and signed with the head's node key over
``REPORT_DOMAIN || body``; like signed peer records the bytes travel unchanged and are never
re-encoded.

The head's signature says only who spread it. Whether it convicts anyone is the evidence's
own business: :func:`open_report` runs exactly the checks ``meshnode audit verify`` runs
(:func:`meshnode.audit.evidence.check_evidence`), so a head cannot frame a node: without the
accused's own signature over the disputed output (and two other nodes' agreeing signatures
for the same input) a report is refused, whoever signed it. Sizes are checked before
anything is parsed, and every refusal names one stable code (:class:`ReportFault`'s values,
or the evidence's :class:`~meshnode.audit.evidence.EvidenceFault` values).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from meshnode.audit.commitment import MAX_COMMITMENT_BYTES, layers
from meshnode.audit.evidence import MAX_WITNESSES, Verdict, check_evidence
from meshnode.audit.handoff import MAX_HANDOFF_BYTES
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import NODE_ID_BYTES, NodeIdentity, short_id, verify_signature
from meshnode.wire.pb import shard

# Differs from every other use of a node key (peer records, commitments, relay seal, certificates).
REPORT_DOMAIN = b"meshnode/v1/evidence-report\0"
# A signed commitment is at most MAX_COMMITMENT_BYTES and its signature (meshnode.audit.commitment),
# a signed handoff at most MAX_HANDOFF_BYTES and its signature: the accused's commitment,
# MAX_WITNESSES others, the accused's handoff and the report's few fields fit with room. A larger
# body is refused before it is parsed.
MAX_REPORT_BODY_BYTES = (MAX_WITNESSES + 1) * (MAX_COMMITMENT_BYTES + 96) + MAX_HANDOFF_BYTES + 96 + 512
MAX_REPORT_SIGNATURE_BYTES = 64


class ReportFault(enum.Enum):
    """Why a report is refused before its evidence is looked at (the value is the code counted)."""

    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    # The body is not signed by the head it names as its reporter.
    REPORTER_UNSIGNED = "reporter_unsigned"
    OTHER_MESH = "other_mesh"


class ReportRejected(Exception):
    def __init__(self, code: str, detail: str) -> None:
        # A ReportFault value, or an EvidenceFault value when the evidence itself does not convict.
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


# (accused, route session, step, layers): one disputed unit. The first report of it is kept.
DisputedUnit = tuple[bytes, str, int, tuple[int, int]]


@dataclass(frozen=True)
class HeldEvidence:
    """A report that verified: who reported it, whom its evidence convicts and of what."""

    reporter: bytes
    accused: bytes
    unit: DisputedUnit
    # What `meshnode remove --evidence` cites: the digest of the signed statements (the proof),
    # the same whoever reported it.
    digest: bytes
    verdict: Verdict
    reported_unix: int
    evidence: audit.AuditEvidence
    signed: audit.EvidenceReport

    def to_json(self) -> dict[str, object]:
        start, end = self.unit[3]
        return {
            "accused": short_id(self.accused),
            "accused_id": self.accused.hex(),
            "reporter": short_id(self.reporter),
            "reporter_id": self.reporter.hex(),
            "layers": [start, end],
            "step": self.unit[2],
            "digest": self.digest.hex(),
            "reported_unix": self.reported_unix,
            "verdict": self.verdict.detail,
            # The evidence file's own JSON: `meshnode audit verify` and `meshnode remove --evidence`
            # read it as it is.
            "evidence": json_format.MessageToDict(self.evidence),
        }


def evidence_digest(evidence: audit.AuditEvidence) -> bytes:
    """SHA-256 over the signed statements exactly as their signers serialized them (the accused's
    first, then its handoff where the evidence is of that kind), length-prefixed: who assembled the
    evidence, and when, does not change it."""
    hasher = hashlib.sha256(b"meshnode/v1/evidence-digest\0")
    parts: list[bytes] = []
    for signed in (evidence.accused, *evidence.witnesses):
        parts += [bytes(signed.commitment), bytes(signed.signature)]
    if evidence.HasField("accused_handoff"):
        handoff = evidence.accused_handoff
        parts += [b"handoff", bytes(handoff.handoff), bytes(handoff.signature)]
    for part in parts:
        hasher.update(struct.pack("<Q", len(part)))
        hasher.update(part)
    return hasher.digest()


def sign_report(
    identity: NodeIdentity, evidence: audit.AuditEvidence, *, mesh_id: str, unix_now: float
) -> audit.EvidenceReport:
    body = audit.EvidenceReportBody(
        reporter_id=identity.node_id, mesh_id=mesh_id, reported_unix=int(unix_now), evidence=evidence
    ).SerializeToString(deterministic=True)
    return audit.EvidenceReport(body=body, signature=identity.sign(REPORT_DOMAIN + body))


def open_report(report: audit.EvidenceReport, *, mesh_id: str) -> HeldEvidence:
    """The report's evidence once the head's signature and the evidence itself check out; else
    :class:`ReportRejected` with the exact code."""
    body_bytes, signature = bytes(report.body), bytes(report.signature)
    if len(body_bytes) > MAX_REPORT_BODY_BYTES or len(signature) > MAX_REPORT_SIGNATURE_BYTES:
        raise ReportRejected(
            ReportFault.OVERSIZED.value,
            f"a report of {len(body_bytes)} bytes (at most {MAX_REPORT_BODY_BYTES})",
        )
    try:
        body = audit.EvidenceReportBody.FromString(body_bytes)
    except DecodeError:
        raise ReportRejected(ReportFault.MALFORMED.value, "the report does not decode") from None
    reporter = bytes(body.reporter_id)
    if len(reporter) != NODE_ID_BYTES:
        raise ReportRejected(ReportFault.MALFORMED.value, "the report's reporter_id is not a node id")
    # The head's signature first: nothing in an unauthenticated report is worth checking further.
    if not verify_signature(reporter, signature, REPORT_DOMAIN + body_bytes):
        raise ReportRejected(
            ReportFault.REPORTER_UNSIGNED.value, f"not signed by {short_id(reporter)}, the head it names"
        )
    if body.mesh_id != mesh_id:
        raise ReportRejected(ReportFault.OTHER_MESH.value, "the report names another mesh")
    verdict = check_evidence(body.evidence)
    if not verdict.convicted or verdict.accused is None or verdict.accused_commitment is None:
        code = verdict.fault.value if verdict.fault is not None else ReportFault.MALFORMED.value
        raise ReportRejected(code, verdict.detail)
    accused: shard.UnitCommitment = verdict.accused_commitment
    unit: DisputedUnit = (
        verdict.accused,
        accused.route_session_id,
        accused.idempotency_step,
        layers(accused),
    )
    return HeldEvidence(
        reporter=reporter,
        accused=verdict.accused,
        unit=unit,
        digest=evidence_digest(body.evidence),
        verdict=verdict,
        reported_unix=body.reported_unix,
        evidence=body.evidence,
        signed=audit.EvidenceReport(body=body_bytes, signature=signature),
    )


__all__ = [
    "MAX_REPORT_BODY_BYTES",
    "REPORT_DOMAIN",
    "DisputedUnit",
    "HeldEvidence",
    "ReportFault",
    "ReportRejected",
    "evidence_digest",
    "open_report",
    "sign_report",
]
