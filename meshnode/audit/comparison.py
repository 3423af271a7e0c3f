"""Comparing two runs of one generation hop by hop, and judging a disputed unit. Pure.

An audit has the commitments of a generation as it ran and of its replay on other replicas
(same units, same ranges). Walking the units in step order and, within a step, the hops in
route order, the first place where the two runs were given the same input (equal chained
input digests) and stated different outputs is where someone lied: :func:`first_divergence`.
A hop that declares inexact numerics is never a divergence: its differences are counted as
checked within tolerance, and what follows it is not compared (its inputs differ).

:func:`judge` takes every statement gathered for one disputed unit (the two runs', and the
third computations') and, once two nodes other than one signer agree on an output that signer
contradicts, returns that signer and the evidence (:mod:`meshnode.audit.evidence`).

:func:`forwarding_conviction` needs no replay: a hop's commitment carries the handoff the hop
before it signed for the unit (:mod:`meshnode.audit.handoff`), and a handoff stating other bytes
than its signer's own commitment convicts that signer by its own two signatures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshnode.audit.commitment import (
    CommitmentRejected,
    decode_commitment,
    is_exact,
    layers,
    open_commitment,
    signed_by_its_node,
)
from meshnode.audit.evidence import MIN_WITNESSES, assemble, check_evidence
from meshnode.audit.handoff import HandoffRejected, contradicts, decode_handoff
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.wire.pb import shard

# (the layers a hop ran, the unit's step)
UnitKey = tuple[tuple[int, int], int]


@dataclass(frozen=True)
class Statement:
    """A commitment that decoded, with its signed form kept as evidence. Its signature is checked
    only when it is judged on (:func:`judge`): comparing a long generation's every commitment
    would otherwise cost the head one signature check each, and a forged one can at most send an
    audit to a third computation that finds nothing."""

    commitment: shard.UnitCommitment
    signed: shard.SignedCommitment

    @property
    def signer(self) -> bytes:
        return bytes(self.commitment.node_id)

    @property
    def key(self) -> UnitKey:
        return layers(self.commitment), self.commitment.idempotency_step


@dataclass(frozen=True)
class RunStatements:
    by_key: dict[UnitKey, Statement]
    # Commitments that did not decode (malformed, or with a bad signature when checked): never
    # compared, only counted.
    unopened: int


def statements(
    signed: Iterable[shard.SignedCommitment], *, epoch: int | None = None, verify: bool = False
) -> RunStatements:
    """The statements of one run (of one epoch, when given), one per hop and unit; ``verify``:
    only those whose signature checks out (otherwise :func:`judge` checks the ones it uses)."""
    by_key: dict[UnitKey, Statement] = {}
    unopened = 0
    for each in signed:
        try:
            commitment = open_commitment(each) if verify else decode_commitment(each)
        except CommitmentRejected:
            unopened += 1
            continue
        if epoch is not None and commitment.route_epoch != epoch:
            continue
        statement = Statement(commitment, each)
        by_key.setdefault(statement.key, statement)
    return RunStatements(by_key, unopened)


@dataclass(frozen=True)
class Divergence:
    key: UnitKey
    original: Statement
    replay: Statement


@dataclass(frozen=True)
class Comparison:
    # Units whose hops in both runs were given the same input and compared.
    compared: int
    # Differences at hops declaring inexact numerics: checked within tolerance, never convicted.
    within_tolerance: int
    # The first place where equal inputs gave different outputs at exact hops; None: none.
    divergence: Divergence | None


def _comparable(a: shard.UnitCommitment, b: shard.UnitCommitment) -> bool:
    return (
        is_exact(a)
        and is_exact(b)
        and a.recipe_digest == b.recipe_digest
        and a.numerics_detail == b.numerics_detail
    )


def first_divergence(
    original: RunStatements, replay: RunStatements, hop_layers: Sequence[tuple[int, int]]
) -> Comparison:
    compared = within_tolerance = 0
    steps = sorted({key[1] for key in original.by_key} & {key[1] for key in replay.by_key})
    for step in steps:
        for hop in hop_layers:
            ours, theirs = original.by_key.get((hop, step)), replay.by_key.get((hop, step))
            if ours is None or theirs is None:
                continue
            if ours.commitment.input_digest != theirs.commitment.input_digest:
                continue
            compared += 1
            if ours.commitment.output_digest == theirs.commitment.output_digest:
                continue
            if not _comparable(ours.commitment, theirs.commitment):
                within_tolerance += 1
                continue
            return Comparison(compared, within_tolerance, Divergence((hop, step), ours, theirs))
    return Comparison(compared, within_tolerance, None)


@dataclass(frozen=True)
class Conviction:
    accused: bytes
    evidence: audit.AuditEvidence


def judge(
    gathered: Sequence[Statement], *, reporter_id: bytes = b"", unix_now_ns: int = 0
) -> Conviction | None:
    """The signer two other nodes contradict, with the evidence; None while no output has two
    witnesses against someone. Statements not signed by their node, and those for other inputs
    than the first signed one's, are left out."""
    signed = [s for s in gathered if signed_by_its_node(s.signed, s.commitment)]
    if not signed:
        return None
    first = signed[0].commitment
    same_input = [s for s in signed if s.commitment.input_digest == first.input_digest]
    by_output: dict[bytes, dict[bytes, Statement]] = {}
    for statement in same_input:
        by_output.setdefault(bytes(statement.commitment.output_digest), {}).setdefault(
            statement.signer, statement
        )
    for output, signers in by_output.items():
        for statement in same_input:
            if statement.commitment.output_digest == output:
                continue
            witnesses = [w for signer, w in signers.items() if signer != statement.signer]
            if len(witnesses) < MIN_WITNESSES:
                continue
            evidence = assemble(
                statement.signed,
                [w.signed for w in witnesses[:MIN_WITNESSES]],
                reporter_id=reporter_id,
                convicted_unix_nanos=unix_now_ns,
            )
            # Never act on less than what anyone could check offline.
            if check_evidence(evidence).convicted:
                return Conviction(statement.signer, evidence)
    return None


def forwarding_conviction(
    run: RunStatements, *, reporter_id: bytes = b"", unix_now_ns: int = 0
) -> Conviction | None:
    """A hop of ``run`` whose handoff (carried in the next hop's commitment) states other bytes
    than its own commitment's output, with the evidence; None when every handoff agrees."""
    by_signer = {(s.signer, s.commitment.idempotency_step): s for s in run.by_key.values()}
    for receiver in run.by_key.values():
        if not receiver.commitment.HasField("input_handoff"):
            continue
        signed_handoff = receiver.commitment.input_handoff
        try:
            # Signatures are checked once a contradiction is found (check_evidence): an audit
            # does not pay two signature checks per hop and unit to find none.
            handoff = decode_handoff(signed_handoff)
        except HandoffRejected:
            continue
        sender = by_signer.get((bytes(handoff.node_id), handoff.idempotency_step))
        if sender is None or not contradicts(handoff, sender.commitment):
            continue
        evidence = assemble(
            sender.signed,
            [],
            reporter_id=reporter_id,
            convicted_unix_nanos=unix_now_ns,
            accused_handoff=signed_handoff,
        )
        if check_evidence(evidence).convicted:
            return Conviction(sender.signer, evidence)
    return None


__all__ = [
    "Comparison",
    "Conviction",
    "Divergence",
    "RunStatements",
    "Statement",
    "UnitKey",
    "first_divergence",
    "forwarding_conviction",
    "judge",
    "statements",
]
