"""Evidence built from real signatures, and evidence reports as a head signs them, for the tests of
evidence gossip: one liar's commitment against two honest replicas' for the same unit."""

from __future__ import annotations

from meshnode.audit.commitment import COMMITMENT_DOMAIN, CommitmentSigner
from meshnode.audit.evidence import assemble
from meshnode.audit.evidence_report import REPORT_DOMAIN, sign_report
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard

FINGERPRINT = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)
NUMERICS = "numpy float32; cpu"
INPUT = b"\x11" * 32
RIGHT = b"\x22" * 32
WRONG = b"\x33" * 32
NOW = 1_900_000_000.0


def commit(
    identity: NodeIdentity, output: bytes, *, session: str = "s", step: int = 5
) -> shard.SignedCommitment:
    signer = CommitmentSigner.for_engine(identity, FINGERPRINT, exact=True, numerics=NUMERICS)
    return signer.sign(
        shard_range=(2, 4, 2),
        session_id=session,
        epoch=1,
        step=step,
        work_id=f"w{step}",
        first_position=9,
        token_count=1,
        input_digest=INPUT,
        output=output,
    )


def evidence_against(
    liar: NodeIdentity, witnesses: tuple[NodeIdentity, NodeIdentity], *, step: int = 5
) -> audit.AuditEvidence:
    """Evidence that convicts ``liar`` of unit ``step``: its own statement, two agreeing others."""
    return assemble(
        commit(liar, WRONG, step=step),
        [commit(w, RIGHT, session=f"replay-{i}", step=step) for i, w in enumerate(witnesses)],
    )


def framed(liar: NodeIdentity, head: NodeIdentity, witnesses: tuple[NodeIdentity, NodeIdentity]):
    """What a head would like to say of ``liar``: its statement, signed by the head instead."""
    body = commit(liar, WRONG).commitment
    accused = shard.SignedCommitment(commitment=body, signature=head.sign(COMMITMENT_DOMAIN + body))
    return assemble(accused, [commit(w, RIGHT, session=f"replay-{i}") for i, w in enumerate(witnesses)])


def disagreeing(liar: NodeIdentity, witnesses: tuple[NodeIdentity, NodeIdentity]) -> audit.AuditEvidence:
    """The two others disagree among themselves: nobody is convicted."""
    first, second = witnesses
    return assemble(commit(liar, WRONG), [commit(first, RIGHT), commit(second, b"\x55" * 32)])


def report(
    head: NodeIdentity, evidence: audit.AuditEvidence, mesh_id: str, *, unix_now: float = NOW
) -> audit.EvidenceReport:
    return sign_report(head, evidence, mesh_id=mesh_id, unix_now=unix_now)


def badly_signed(head: NodeIdentity, impostor: NodeIdentity, evidence: audit.AuditEvidence, mesh_id: str):
    """A report naming ``head`` as its reporter, signed by ``impostor``."""
    body = report(head, evidence, mesh_id).body
    return audit.EvidenceReport(body=body, signature=impostor.sign(REPORT_DOMAIN + body))
