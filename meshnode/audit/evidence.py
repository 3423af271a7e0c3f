"""Evidence that a node computed wrong, assembled from signed commitments and checked by anyone. Pure.

Evidence (``meshnode.v1.AuditEvidence``) is the accused node's own signed commitment and at
least two commitments signed by other nodes, each a different one, for the same layers,
recipe, numerics and chained input digest, agreeing among themselves on an output digest
other than the accused's. Every statement in it is signed by the node that made it, so the
head that assembled it cannot frame anyone: without the accused's own signature over the
disputed output there is nothing to check, and :func:`check_evidence` says so.

A commitment that declares inexact numerics (a GPU, repacked weights) is never evidence: such
hops are compared within a tolerance only, and the verdict says "checked within tolerance".

Evidence of a second kind needs no witness: the accused's own commitment and its own signed
handoff (:mod:`meshnode.audit.handoff`) for the same unit, stating that it sent other hidden
states than the output it committed to (``accused_handoff``, no witnesses). Both statements
are the accused's, about its own bytes, so numerics do not enter: a hop sends what it computed,
whatever its numerics. Without the accused's signature on both there is nothing to check.

The faults are stable codes (:class:`EvidenceFault`): scripts and tests read them, and a
verdict names exactly one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from meshnode.audit.commitment import CommitmentRejected, is_exact, layers, open_commitment
from meshnode.audit.handoff import STATED_DTYPE, HandoffRejected, open_handoff, same_unit
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import short_id
from meshnode.wire.pb import shard

# The commitments two replicas need besides the accused's: two agreeing nodes outvote one.
MIN_WITNESSES = 2
# More is never needed; a file with more is not read further (64 KiB covers them with room).
MAX_WITNESSES = 8
MAX_EVIDENCE_BYTES = 64 * 1024


class EvidenceFault(enum.Enum):
    """Why evidence is not evidence (the value is the code printed and tested)."""

    MALFORMED = "malformed"
    ACCUSED_UNSIGNED = "accused_unsigned"
    WITNESS_UNSIGNED = "witness_unsigned"
    TOO_FEW_WITNESSES = "too_few_witnesses"
    TOO_MANY_WITNESSES = "too_many_witnesses"
    WITNESS_IS_ACCUSED = "witness_is_accused"
    REPEATED_WITNESS = "repeated_witness"
    OTHER_LAYERS = "other_layers"
    OTHER_RECIPE = "other_recipe"
    OTHER_NUMERICS = "other_numerics"
    OTHER_INPUT = "other_input"
    WITNESSES_DISAGREE = "witnesses_disagree"
    NO_DISAGREEMENT = "no_disagreement"
    # Not a fault of the file: a hop with inexact numerics is compared within a tolerance only.
    WITHIN_TOLERANCE = "within_tolerance"
    # Handoff evidence (the accused's commitment against its own handoff):
    HANDOFF_UNSIGNED = "handoff_unsigned"
    HANDOFF_OTHER_SIGNER = "handoff_other_signer"
    HANDOFF_OTHER_UNIT = "handoff_other_unit"
    HANDOFF_OTHER_DTYPE = "handoff_other_dtype"
    HANDOFF_WITH_WITNESSES = "handoff_with_witnesses"


class Outcome(enum.Enum):
    CONVICTED = "convicted"
    CHECKED_WITHIN_TOLERANCE = "checked within tolerance"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    detail: str
    fault: EvidenceFault | None = None
    # The accused, once its own commitment opened.
    accused: bytes | None = None
    accused_commitment: shard.UnitCommitment | None = None

    @property
    def convicted(self) -> bool:
        return self.outcome is Outcome.CONVICTED

    def line(self) -> str:
        code = "" if self.fault is None else f" [{self.fault.value}]"
        return f"{self.outcome.value}{code}: {self.detail}"


def _rejected(fault: EvidenceFault, detail: str, accused: bytes | None = None) -> Verdict:
    outcome = (
        Outcome.CHECKED_WITHIN_TOLERANCE if fault is EvidenceFault.WITHIN_TOLERANCE else Outcome.REJECTED
    )
    return Verdict(outcome, detail, fault, accused)


def _layers_text(commitment: shard.UnitCommitment) -> str:
    start, end = layers(commitment)
    return f"[{start},{end})"


def assemble(
    accused: shard.SignedCommitment,
    witnesses: list[shard.SignedCommitment],
    *,
    reporter_id: bytes = b"",
    convicted_unix_nanos: int = 0,
    accused_handoff: shard.SignedHandoff | None = None,
) -> audit.AuditEvidence:
    return audit.AuditEvidence(
        accused=accused,
        witnesses=witnesses,
        reporter_id=reporter_id,
        convicted_unix_nanos=convicted_unix_nanos,
        accused_handoff=accused_handoff,
    )


def check_evidence(evidence: audit.AuditEvidence) -> Verdict:
    """Whether ``evidence`` convicts its accused; every fault found first is named."""
    try:
        accused = open_commitment(evidence.accused)
    except CommitmentRejected as error:
        return _rejected(
            EvidenceFault.ACCUSED_UNSIGNED, f"the accused's own commitment does not stand: {error}"
        )
    accused_id = bytes(accused.node_id)
    who = short_id(accused_id)
    if evidence.HasField("accused_handoff"):
        return _check_handoff_evidence(evidence, accused)
    if len(evidence.witnesses) < MIN_WITNESSES:
        return _rejected(
            EvidenceFault.TOO_FEW_WITNESSES,
            f"{len(evidence.witnesses)} other commitments (at least {MIN_WITNESSES})",
            accused_id,
        )
    if len(evidence.witnesses) > MAX_WITNESSES:
        return _rejected(
            EvidenceFault.TOO_MANY_WITNESSES,
            f"{len(evidence.witnesses)} other commitments (at most {MAX_WITNESSES})",
            accused_id,
        )
    witnesses: list[shard.UnitCommitment] = []
    for index, signed in enumerate(evidence.witnesses):
        try:
            witnesses.append(open_commitment(signed))
        except CommitmentRejected as error:
            return _rejected(EvidenceFault.WITNESS_UNSIGNED, f"commitment {index + 1}: {error}", accused_id)
    signers = [bytes(w.node_id) for w in witnesses]
    if accused_id in signers:
        return _rejected(EvidenceFault.WITNESS_IS_ACCUSED, f"{who} witnesses against itself", accused_id)
    if len(set(signers)) != len(signers):
        return _rejected(EvidenceFault.REPEATED_WITNESS, "one node signed two of the others", accused_id)
    inexact = [c for c in (accused, *witnesses) if not is_exact(c)]
    if inexact:
        return _rejected(
            EvidenceFault.WITHIN_TOLERANCE,
            f"{short_id(bytes(inexact[0].node_id))} declares inexact numerics "
            f"({inexact[0].numerics_detail or 'unstated'}): never evidence",
            accused_id,
        )
    for witness in witnesses:
        if layers(witness) != layers(accused):
            return _rejected(
                EvidenceFault.OTHER_LAYERS,
                f"{short_id(bytes(witness.node_id))} ran {_layers_text(witness)}, "
                f"the accused {_layers_text(accused)}",
                accused_id,
            )
        if witness.recipe_digest != accused.recipe_digest:
            return _rejected(EvidenceFault.OTHER_RECIPE, "the commitments name other recipes", accused_id)
        if witness.numerics_detail != accused.numerics_detail:
            return _rejected(
                EvidenceFault.OTHER_NUMERICS,
                f"{witness.numerics_detail!r} against the accused's {accused.numerics_detail!r}",
                accused_id,
            )
        if witness.input_digest != accused.input_digest:
            return _rejected(EvidenceFault.OTHER_INPUT, "the commitments were given other inputs", accused_id)
    outputs = {bytes(w.output_digest) for w in witnesses}
    if len(outputs) != 1:
        return _rejected(
            EvidenceFault.WITNESSES_DISAGREE, "the other nodes disagree among themselves", accused_id
        )
    if bytes(accused.output_digest) in outputs:
        return _rejected(EvidenceFault.NO_DISAGREEMENT, f"{who} stated the same output", accused_id)
    return Verdict(
        Outcome.CONVICTED,
        f"{who} computed layers {_layers_text(accused)} wrong: given the input "
        f"{bytes(accused.input_digest).hex()[:16]}… it stated output {bytes(accused.output_digest).hex()[:16]}…, "
        f"{len(witnesses)} other nodes ({', '.join(short_id(s) for s in signers)}) "
        f"stated {next(iter(outputs)).hex()[:16]}…",
        None,
        accused_id,
        accused,
    )


def _check_handoff_evidence(evidence: audit.AuditEvidence, accused: shard.UnitCommitment) -> Verdict:
    """The accused's commitment (opened) against its own handoff for the same unit."""
    accused_id = bytes(accused.node_id)
    who = short_id(accused_id)
    if evidence.witnesses:
        return _rejected(
            EvidenceFault.HANDOFF_WITH_WITNESSES,
            "a handoff against a commitment needs no other nodes' commitments",
            accused_id,
        )
    try:
        handoff = open_handoff(evidence.accused_handoff)
    except HandoffRejected as error:
        return _rejected(
            EvidenceFault.HANDOFF_UNSIGNED, f"the accused's handoff does not stand: {error}", accused_id
        )
    if bytes(handoff.node_id) != accused_id:
        return _rejected(
            EvidenceFault.HANDOFF_OTHER_SIGNER,
            f"the handoff is {short_id(bytes(handoff.node_id))}'s, the commitment {who}'s",
            accused_id,
        )
    if not same_unit(
        handoff,
        session_id=accused.route_session_id,
        epoch=accused.route_epoch,
        step=accused.idempotency_step,
        work_id=accused.work_id,
    ):
        return _rejected(
            EvidenceFault.HANDOFF_OTHER_UNIT, "the handoff and the commitment name other units", accused_id
        )
    if handoff.boundary_dtype != STATED_DTYPE:
        return _rejected(
            EvidenceFault.HANDOFF_OTHER_DTYPE,
            "the handoff states hidden states in another dtype than the hop computed",
            accused_id,
        )
    if handoff.sent_digest == accused.output_digest:
        return _rejected(EvidenceFault.NO_DISAGREEMENT, f"{who} sent the output it computed", accused_id)
    return Verdict(
        Outcome.CONVICTED,
        f"{who} passed on other bytes than it computed: for layers {_layers_text(accused)} at step "
        f"{accused.idempotency_step} it stated output {bytes(accused.output_digest).hex()[:16]}… and "
        f"signed that it sent {bytes(handoff.sent_digest).hex()[:16]}… to the next hop",
        None,
        accused_id,
        accused,
    )


def encode_evidence(evidence: audit.AuditEvidence) -> bytes:
    """The evidence file's text: JSON (bytes as base64), so it can be read, mailed and quoted."""
    return (json_format.MessageToJson(evidence, sort_keys=True) + "\n").encode()


def decode_evidence(data: bytes) -> audit.AuditEvidence | Verdict:
    """The evidence in a file (its JSON, or the binary message), or a MALFORMED verdict."""
    if len(data) > MAX_EVIDENCE_BYTES:
        return _rejected(
            EvidenceFault.MALFORMED, f"{len(data)} bytes (evidence is at most {MAX_EVIDENCE_BYTES})"
        )
    evidence = audit.AuditEvidence()
    try:
        if data.lstrip()[:1] == b"{":
            json_format.Parse(data.decode(), evidence)
        else:
            evidence.ParseFromString(data)
    except (json_format.ParseError, DecodeError, UnicodeDecodeError) as error:
        return _rejected(EvidenceFault.MALFORMED, f"not audit evidence: {error}")
    return evidence


def verify_evidence_bytes(data: bytes) -> Verdict:
    decoded = decode_evidence(data)
    return decoded if isinstance(decoded, Verdict) else check_evidence(decoded)


__all__ = [
    "MAX_EVIDENCE_BYTES",
    "MAX_WITNESSES",
    "MIN_WITNESSES",
    "EvidenceFault",
    "Outcome",
    "Verdict",
    "assemble",
    "check_evidence",
    "decode_evidence",
    "encode_evidence",
    "verify_evidence_bytes",
]
