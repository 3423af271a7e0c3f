"""Evidence: the accused's own signed commitment against two agreeing others, checked offline.

Every way a file can fail to be evidence is named by its exact code; ``meshnode audit verify``
prints the verdict and exits 0 only for evidence that convicts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.app.audit_command import EXIT_CONVICTED, EXIT_NOT_EVIDENCE, EXIT_UNREADABLE
from meshnode.app.cli import main
from meshnode.audit.commitment import COMMITMENT_DOMAIN, CommitmentSigner
from meshnode.audit.evidence import (
    MAX_EVIDENCE_BYTES,
    EvidenceFault,
    Outcome,
    assemble,
    check_evidence,
    encode_evidence,
    verify_evidence_bytes,
)
from meshnode.identity import NodeIdentity, short_id
from meshnode.wire.pb import shard

LIAR, HONEST_A, HONEST_B, HONEST_C = (NodeIdentity.from_seed(bytes([i]) * 32) for i in range(4))
FINGERPRINT = shard.Fingerprint(model_artifact_digest="m" * 64, runtime_recipe_digest="r" * 64)
NUMERICS = "numpy float32; cpu"
INPUT = b"\x11" * 32
RIGHT = b"\x22" * 32
WRONG = b"\x33" * 32
REPO = Path(__file__).resolve().parents[2]


def commit(
    identity: NodeIdentity,
    output: bytes,
    *,
    input_digest: bytes = INPUT,
    layers: tuple[int, int, int] = (2, 4, 2),
    exact: bool = True,
    numerics: str = NUMERICS,
    fingerprint: shard.Fingerprint = FINGERPRINT,
    session: str = "s",
) -> shard.SignedCommitment:
    signer = CommitmentSigner.for_engine(identity, fingerprint, exact=exact, numerics=numerics)
    return signer.sign(
        shard_range=layers,
        session_id=session,
        epoch=1,
        step=5,
        work_id="w5",
        first_position=9,
        token_count=1,
        input_digest=input_digest,
        output=output,
    )


def valid_evidence():
    return assemble(
        commit(LIAR, WRONG),
        [commit(HONEST_A, RIGHT, session="replay-1"), commit(HONEST_B, RIGHT, session="replay-2")],
        reporter_id=HONEST_C.node_id,
    )


def test_two_agreeing_replicas_convict_the_node_that_signed_another_output():
    verdict = check_evidence(valid_evidence())
    assert verdict.outcome is Outcome.CONVICTED and verdict.fault is None
    assert verdict.accused == LIAR.node_id
    assert short_id(LIAR.node_id) in verdict.line() and "[2,4)" in verdict.line()


def test_the_file_round_trips_as_json_and_as_binary():
    evidence = valid_evidence()
    assert verify_evidence_bytes(encode_evidence(evidence)).convicted
    assert verify_evidence_bytes(evidence.SerializeToString()).convicted


def broken(**changes) -> shard.SignedCommitment:
    return commit(HONEST_B, RIGHT, **changes)


def forged_by_head() -> shard.SignedCommitment:
    """The liar's statement as a head would like it to read, signed by the head (HONEST_C)."""
    body = commit(LIAR, WRONG).commitment
    return shard.SignedCommitment(commitment=body, signature=HONEST_C.sign(COMMITMENT_DOMAIN + body))


@pytest.mark.parametrize(
    "accused, witnesses, fault",
    [
        # A head cannot frame a node: the accused's statement must carry the accused's signature.
        (
            forged_by_head(),
            [commit(HONEST_A, RIGHT), commit(HONEST_B, RIGHT)],
            EvidenceFault.ACCUSED_UNSIGNED,
        ),
        (
            shard.SignedCommitment(),
            [commit(HONEST_A, RIGHT), commit(HONEST_B, RIGHT)],
            EvidenceFault.ACCUSED_UNSIGNED,
        ),
        (commit(LIAR, WRONG), [commit(HONEST_A, RIGHT)], EvidenceFault.TOO_FEW_WITNESSES),
        (commit(LIAR, WRONG), [commit(HONEST_A, RIGHT)] * 9, EvidenceFault.TOO_MANY_WITNESSES),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), shard.SignedCommitment(commitment=commit(HONEST_B, RIGHT).commitment)],
            EvidenceFault.WITNESS_UNSIGNED,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), commit(LIAR, RIGHT)],
            EvidenceFault.WITNESS_IS_ACCUSED,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), commit(HONEST_A, RIGHT)],
            EvidenceFault.REPEATED_WITNESS,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), broken(layers=(2, 4, 3))],
            EvidenceFault.OTHER_LAYERS,
        ),
        (
            commit(LIAR, WRONG),
            [
                commit(HONEST_A, RIGHT),
                broken(fingerprint=shard.Fingerprint(model_artifact_digest="x", runtime_recipe_digest="r")),
            ],
            EvidenceFault.OTHER_RECIPE,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), broken(numerics="numpy float32; cpu; other build")],
            EvidenceFault.OTHER_NUMERICS,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), broken(input_digest=b"\x44" * 32)],
            EvidenceFault.OTHER_INPUT,
        ),
        (
            commit(LIAR, WRONG),
            [commit(HONEST_A, RIGHT), commit(HONEST_B, b"\x55" * 32)],
            EvidenceFault.WITNESSES_DISAGREE,
        ),
        (
            commit(LIAR, RIGHT),
            [commit(HONEST_A, RIGHT), commit(HONEST_B, RIGHT)],
            EvidenceFault.NO_DISAGREEMENT,
        ),
    ],
)
def test_what_is_not_evidence_is_rejected_with_its_exact_code(accused, witnesses, fault):
    verdict = check_evidence(assemble(accused, witnesses))
    assert verdict.outcome is Outcome.REJECTED
    assert verdict.fault is fault
    assert f"[{fault.value}]" in verdict.line()


@pytest.mark.parametrize("inexact", ["accused", "witness"])
def test_a_hop_declaring_inexact_numerics_is_only_checked_within_tolerance(inexact):
    gpu = "llama-cpp-python 0.3.36; gpu; weight repack off"
    accused = commit(LIAR, WRONG, exact=inexact != "accused", numerics=gpu)
    witnesses = [
        commit(HONEST_A, RIGHT, exact=inexact != "witness", numerics=gpu),
        commit(HONEST_B, RIGHT, numerics=gpu),
    ]
    verdict = check_evidence(assemble(accused, witnesses))
    assert verdict.outcome is Outcome.CHECKED_WITHIN_TOLERANCE
    assert verdict.fault is EvidenceFault.WITHIN_TOLERANCE and not verdict.convicted
    assert verdict.line().startswith("checked within tolerance")


def test_a_file_that_is_not_evidence_or_too_large_is_malformed():
    assert verify_evidence_bytes(b"{not json").fault is EvidenceFault.MALFORMED
    assert verify_evidence_bytes(b"\xff\xff\xff").fault is EvidenceFault.MALFORMED
    assert verify_evidence_bytes(b" " * (MAX_EVIDENCE_BYTES + 1)).fault is EvidenceFault.MALFORMED


def test_meshnode_audit_verify_exits_by_the_verdict(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_bytes(encode_evidence(valid_evidence()))
    framed = tmp_path / "framed.json"
    framed.write_bytes(
        encode_evidence(assemble(forged_by_head(), [commit(HONEST_A, RIGHT), commit(HONEST_B, RIGHT)]))
    )
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"{]")
    assert main(["audit", "verify", str(good)]) == EXIT_CONVICTED
    assert capsys.readouterr().out.startswith("convicted: ")
    assert main(["audit", "verify", str(framed)]) == EXIT_NOT_EVIDENCE
    assert capsys.readouterr().out.startswith("rejected [accused_unsigned]: ")
    assert main(["audit", "verify", str(garbage)]) == EXIT_UNREADABLE
    assert main(["audit", "verify", str(tmp_path / "missing.json")]) == EXIT_UNREADABLE
    assert "cannot read" in capsys.readouterr().err


def test_the_installed_command_checks_a_file_with_no_mesh_at_all(tmp_path):
    good = tmp_path / "evidence.json"
    good.write_bytes(encode_evidence(valid_evidence()))
    run = subprocess.run(
        [sys.executable, "-m", "meshnode", "audit", "verify", str(good)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == EXIT_CONVICTED, run.stderr
    assert run.stdout.startswith("convicted: ")
