"""`meshnode remove --evidence FILE`: the admin's removal checks the evidence first and cites its
digest as the reason; evidence that does not convict, or convicts someone else, removes nobody.
(The removal of a running mesh's accused is in test_evidence_gossip.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from audit.signed_evidence import RIGHT, WRONG, commit, evidence_against, framed
from meshnode.app.cli import main
from meshnode.app.member_commands import EVIDENCE_REASON_PREFIX
from meshnode.audit.evidence import assemble, encode_evidence
from meshnode.audit.evidence_report import evidence_digest
from meshnode.audit.handoff import sign_handoff
from meshnode.identity import NodeIdentity, write_private_file
from meshnode.membership.credentials import MeshKey, issue_certificate
from meshnode.membership.revocation import RevocationList
from meshnode.membership.store import DataDir, MembershipState

LIAR, WITNESS_A, WITNESS_B, BYSTANDER = (NodeIdentity.from_seed(bytes([i + 21]) * 32) for i in range(4))


@pytest.fixture
def admin_dir(tmp_path: Path) -> tuple[Path, MeshKey]:
    """An admin's data directory, its node not running (a removal is kept for its next start)."""
    mesh_key, identity, path = MeshKey.generate(), NodeIdentity.generate(), tmp_path / "admin"
    path.mkdir()
    write_private_file(path / "node_key.pem", identity.to_pem())
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time(), admin=True
    )
    DataDir(path).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))
    return path, mesh_key


def stored_removals(path: Path, mesh_key: MeshKey) -> dict[bytes, str]:
    revocations = RevocationList(mesh_key.mesh_id)
    revocations.learn(DataDir(path).load_revocations())
    return {r.target: r.reason for r in revocations.all()}


def test_the_removal_names_the_accused_and_cites_the_evidence_digest(admin_dir, tmp_path, capsys):
    path, mesh_key = admin_dir
    evidence = evidence_against(LIAR, (WITNESS_A, WITNESS_B))
    file = tmp_path / "evidence.json"
    file.write_bytes(encode_evidence(evidence))
    assert main(["remove", "--evidence", str(file), "--reason", "wrong layers", "--data-dir", str(path)]) == 0
    assert capsys.readouterr().out.startswith("convicted: ")
    digest = evidence_digest(evidence).hex()
    assert stored_removals(path, mesh_key) == {
        LIAR.node_id: f"{EVIDENCE_REASON_PREFIX}{digest}: wrong layers"
    }


def test_evidence_that_does_not_convict_or_names_another_node_removes_nobody(admin_dir, tmp_path, capsys):
    path, mesh_key = admin_dir
    forged = tmp_path / "forged.json"
    forged.write_bytes(encode_evidence(framed(LIAR, BYSTANDER, (WITNESS_A, WITNESS_B))))
    assert main(["remove", "--evidence", str(forged), "--data-dir", str(path)]) == 2
    assert "[accused_unsigned]" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_bytes(encode_evidence(evidence_against(LIAR, (WITNESS_A, WITNESS_B))))
    assert main(["remove", BYSTANDER.node_id.hex(), "--evidence", str(good), "--data-dir", str(path)]) == 2
    assert "the evidence convicts" in capsys.readouterr().err
    assert main(["remove", "--data-dir", str(path)]) == 2
    assert stored_removals(path, mesh_key) == {}


def test_a_hops_own_handoff_against_its_commitment_removes_it_too(admin_dir, tmp_path, capsys):
    path, mesh_key = admin_dir
    handoff = sign_handoff(LIAR, session_id="s", epoch=1, step=5, work_id="w5", sent_digest=WRONG)
    evidence = assemble(commit(LIAR, RIGHT), [], accused_handoff=handoff)
    file = tmp_path / "evidence.json"
    file.write_bytes(encode_evidence(evidence))
    assert main(["remove", "--evidence", str(file), "--data-dir", str(path)]) == 0
    assert "passed on other bytes than it computed" in capsys.readouterr().out
    reason = stored_removals(path, mesh_key)[LIAR.node_id]
    assert reason.startswith(f"{EVIDENCE_REASON_PREFIX}{evidence_digest(evidence).hex()}")


def test_audit_verify_prints_the_digest_a_removal_with_the_evidence_cites(admin_dir, tmp_path, capsys):
    path, mesh_key = admin_dir
    evidence = evidence_against(LIAR, (WITNESS_A, WITNESS_B))
    file = tmp_path / "evidence.json"
    file.write_bytes(encode_evidence(evidence))
    assert main(["audit", "verify", str(file)]) == 0
    verdict_line, digest_line = capsys.readouterr().out.splitlines()
    assert verdict_line.startswith("convicted: ")
    digest = digest_line.removeprefix("evidence digest: ").split()[0]
    assert digest == evidence_digest(evidence).hex()
    assert main(["audit", "verify", "--json", str(file)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer == {
        "outcome": "convicted",
        "fault": None,
        "detail": answer["detail"],
        "accused_id": LIAR.node_id.hex(),
        "digest": digest,
        "removal_reason": f"{EVIDENCE_REASON_PREFIX}{digest}",
    }
    assert main(["remove", "--evidence", str(file), "--data-dir", str(path)]) == 0
    assert stored_removals(path, mesh_key) == {LIAR.node_id: answer["removal_reason"]}


def test_audit_verify_gives_the_digest_of_evidence_that_does_not_convict_and_none_of_garbage(
    tmp_path, capsys
):
    forged = framed(LIAR, BYSTANDER, (WITNESS_A, WITNESS_B))
    file = tmp_path / "forged.json"
    file.write_bytes(encode_evidence(forged))
    assert main(["audit", "verify", "--json", str(file)]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["outcome"] == "rejected" and answer["fault"] == "accused_unsigned"
    assert answer["digest"] == evidence_digest(forged).hex()
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"{]")
    assert main(["audit", "verify", str(garbage)]) == 2
    assert "evidence digest" not in capsys.readouterr().out
    assert main(["audit", "verify", "--json", str(garbage)]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["fault"] == "malformed" and answer["digest"] is None and answer["removal_reason"] is None
