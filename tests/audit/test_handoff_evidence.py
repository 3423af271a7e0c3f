"""Signed handoffs, pure: a hop's statement of what it sent, checked by the receiver against the
bytes it got, and evidence of the second kind: the accused's own commitment against its own
handoff for the same unit. Every way such a file fails to be evidence is named by its exact code,
offline (`meshnode audit verify`) and on gossip (an evidence report)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.interface import StepResult
from meshnode.app.audit_command import EXIT_CONVICTED, EXIT_NOT_EVIDENCE
from meshnode.app.cli import main
from meshnode.audit.commitment import CommitmentSigner, hidden_digest, output_digest
from meshnode.audit.comparison import forwarding_conviction, statements
from meshnode.audit.evidence import (
    EvidenceFault,
    Outcome,
    assemble,
    check_evidence,
    encode_evidence,
    verify_evidence_bytes,
)
from meshnode.audit.evidence_report import ReportRejected, evidence_digest, open_report, sign_report
from meshnode.audit.handoff import (
    HANDOFF_DOMAIN,
    HandoffRejected,
    check_received,
    open_handoff,
    sign_handoff,
)
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import NodeIdentity
from meshnode.wire.pb import shard

SENDER, RECEIVER, HEAD, WITNESS = (NodeIdentity.from_seed(bytes([40 + i]) * 32) for i in range(4))
FINGERPRINT = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)
COMPUTED = np.arange(12, dtype=np.float32).reshape(2, 6) / 7
SENT = COMPUTED.copy()
SENT[1, 3] = np.nextafter(SENT[1, 3], np.float32(np.inf))  # one unit in the last place
MESH = "mesh-under-test"


def commit(
    identity: NodeIdentity,
    output: bytes,
    *,
    layers: tuple[int, int, int] = (0, 2, 0),
    input_handoff: shard.SignedHandoff | None = None,
    step: int = 5,
) -> shard.SignedCommitment:
    signer = CommitmentSigner.for_engine(identity, FINGERPRINT, exact=True, numerics="numpy float32; cpu")
    return signer.sign(
        shard_range=layers,
        session_id="s",
        epoch=1,
        step=step,
        work_id=f"s/1/{step}",
        first_position=0,
        token_count=2,
        input_digest=b"\x11" * 32,
        output=output,
        input_handoff=input_handoff,
    )


def handoff(identity: NodeIdentity, sent: np.ndarray, *, step: int = 5) -> shard.SignedHandoff:
    return sign_handoff(
        identity, session_id="s", epoch=1, step=step, work_id=f"s/1/{step}", sent_digest=hidden_digest(sent)
    )


def received(signed: shard.SignedHandoff, hidden: np.ndarray, *, step: int = 5) -> str | None:
    """What unit 5's receiver says of ``signed`` given ``hidden`` (None: it takes the unit)."""
    return check_received(signed, session_id="s", epoch=1, step=step, work_id=f"s/1/{step}", received=hidden)


def forwarded_other_bytes() -> audit.AuditEvidence:
    """SENDER committed to what it computed and signed that it sent other bytes."""
    return assemble(commit(SENDER, hidden_digest(COMPUTED)), [], accused_handoff=handoff(SENDER, SENT))


def test_a_forwarding_hops_output_digest_is_the_digest_of_what_it_sends():
    assert output_digest(StepResult(hidden=COMPUTED, past_len=2, cache_hit=False)) == hidden_digest(COMPUTED)


def test_the_receiver_takes_a_handoff_of_the_bytes_it_got_and_names_every_other():
    signed = handoff(SENDER, SENT)
    assert received(signed, SENT) is None
    assert received(signed, COMPUTED) == "the sender's signed handoff states other bytes than it sent"
    assert received(signed, SENT, step=6) == "the sender's handoff names another unit"
    assert (
        received(shard.SignedHandoff(handoff=b"\xff" * 1100), SENT)
        == "a handoff of 1100 bytes (at most 1024)"
    )
    # The signature is for whoever acts on it: a forged one states nothing, and convicts no one.
    forged = shard.SignedHandoff(handoff=signed.handoff, signature=HEAD.sign(HANDOFF_DOMAIN + signed.handoff))
    assert received(forged, SENT) is None
    with pytest.raises(HandoffRejected, match="not signed by the node it names"):
        open_handoff(forged)


def test_a_hop_that_signs_other_bytes_than_it_computed_is_convicted_by_its_own_two_signatures(
    tmp_path, capsys
):
    evidence = forwarded_other_bytes()
    verdict = check_evidence(evidence)
    assert verdict.convicted and verdict.accused == SENDER.node_id
    assert "passed on other bytes than it computed" in verdict.detail
    # Offline, as a file: no mesh, no witness.
    path = tmp_path / "evidence.json"
    path.write_bytes(encode_evidence(evidence))
    assert verify_evidence_bytes(path.read_bytes()).accused == SENDER.node_id
    assert main(["audit", "verify", str(path)]) == EXIT_CONVICTED
    assert capsys.readouterr().out.startswith("convicted: ")
    # On gossip, as a head reports it; its digest covers the handoff.
    held = open_report(sign_report(HEAD, evidence, mesh_id=MESH, unix_now=1.0), mesh_id=MESH)
    assert held.accused == SENDER.node_id
    assert held.digest == evidence_digest(evidence) != evidence_digest(assemble(evidence.accused, []))


def framings() -> dict[EvidenceFault, audit.AuditEvidence]:
    honest_commitment = commit(SENDER, hidden_digest(COMPUTED))
    body = handoff(SENDER, SENT).handoff
    head_signed = shard.SignedHandoff(handoff=body, signature=HEAD.sign(HANDOFF_DOMAIN + body))
    other_dtype = shard.UnitHandoff.FromString(body)
    other_dtype.boundary_dtype = shard.DTYPE_BFLOAT16
    other_body = other_dtype.SerializeToString(deterministic=True)
    return {
        # The head signs the handoff it would like the accused to have made.
        EvidenceFault.HANDOFF_UNSIGNED: assemble(honest_commitment, [], accused_handoff=head_signed),
        # The receiver's (or anyone's) handoff is no statement of the accused.
        EvidenceFault.HANDOFF_OTHER_SIGNER: assemble(
            honest_commitment, [], accused_handoff=handoff(RECEIVER, SENT)
        ),
        # A handoff of another unit of the accused's.
        EvidenceFault.HANDOFF_OTHER_UNIT: assemble(
            honest_commitment, [], accused_handoff=handoff(SENDER, SENT, step=6)
        ),
        EvidenceFault.HANDOFF_OTHER_DTYPE: assemble(
            honest_commitment,
            [],
            accused_handoff=shard.SignedHandoff(
                handoff=other_body, signature=SENDER.sign(HANDOFF_DOMAIN + other_body)
            ),
        ),
        # An honest hop's two statements agree.
        EvidenceFault.NO_DISAGREEMENT: assemble(
            honest_commitment, [], accused_handoff=handoff(SENDER, COMPUTED)
        ),
        EvidenceFault.HANDOFF_WITH_WITNESSES: assemble(
            honest_commitment,
            [commit(WITNESS, hidden_digest(SENT))],
            accused_handoff=handoff(SENDER, SENT),
        ),
        # The accused's commitment signed by the head: nothing of the accused's to check.
        EvidenceFault.ACCUSED_UNSIGNED: assemble(
            shard.SignedCommitment(commitment=honest_commitment.commitment, signature=b"\x00" * 64),
            [],
            accused_handoff=handoff(SENDER, SENT),
        ),
    }


@pytest.mark.parametrize("fault", list(framings()))
def test_handoff_evidence_without_the_accuseds_own_contradiction_is_refused_with_its_code(fault, tmp_path):
    evidence = framings()[fault]
    verdict = check_evidence(evidence)
    assert verdict.outcome is Outcome.REJECTED and verdict.fault is fault, verdict.line()
    path = tmp_path / "framed.json"
    path.write_bytes(encode_evidence(evidence))
    assert main(["audit", "verify", str(path)]) == EXIT_NOT_EVIDENCE
    with pytest.raises(ReportRejected) as refused:
        open_report(sign_report(HEAD, evidence, mesh_id=MESH, unix_now=1.0), mesh_id=MESH)
    assert refused.value.code == fault.value


def test_the_head_finds_the_contradiction_in_the_commitments_of_a_generation():
    sender_handoff = handoff(SENDER, SENT)
    run = statements(
        [
            commit(SENDER, hidden_digest(COMPUTED)),
            commit(RECEIVER, b"\x44" * 32, layers=(2, 4, 2), input_handoff=sender_handoff),
        ]
    )
    conviction = forwarding_conviction(run, reporter_id=HEAD.node_id)
    assert conviction is not None and conviction.accused == SENDER.node_id
    assert conviction.evidence.accused_handoff == sender_handoff
    assert check_evidence(conviction.evidence).convicted


def test_agreeing_handoffs_and_commitments_without_one_convict_nobody():
    honest = statements(
        [
            commit(SENDER, hidden_digest(SENT)),
            commit(RECEIVER, b"\x44" * 32, layers=(2, 4, 2), input_handoff=handoff(SENDER, SENT)),
        ]
    )
    assert forwarding_conviction(honest) is None
    # An older sender states nothing: its receiver's commitment carries no handoff.
    older = statements(
        [commit(SENDER, hidden_digest(COMPUTED)), commit(RECEIVER, b"\x44" * 32, layers=(2, 4, 2))]
    )
    assert forwarding_conviction(older) is None
    # A handoff carried in by the receiver but signed by someone else convicts no one.
    body = handoff(SENDER, SENT).handoff
    forged = shard.SignedHandoff(handoff=body, signature=RECEIVER.sign(HANDOFF_DOMAIN + body))
    framed = statements(
        [
            commit(SENDER, hidden_digest(COMPUTED)),
            commit(RECEIVER, b"\x44" * 32, layers=(2, 4, 2), input_handoff=forged),
        ]
    )
    assert forwarding_conviction(framed) is None
