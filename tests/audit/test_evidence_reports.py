"""Evidence reports, pure: a head signs its conviction; every receiver checks the head's signature
and the evidence itself (what `meshnode audit verify` checks) before it keeps or sends anything on,
refuses with the exact code, and holds a bounded share per reporting head."""

from __future__ import annotations

import base64

import pytest

from audit.signed_evidence import (
    NOW,
    badly_signed,
    disagreeing,
    evidence_against,
    framed,
    report,
)
from meshnode.audit.evidence_book import (
    MAX_CHECKS_PER_BATCH,
    MAX_EVIDENCE_REPORTS,
    OVER_CAP,
    EvidenceBook,
)
from meshnode.audit.evidence_report import (
    MAX_REPORT_BODY_BYTES,
    ReportRejected,
    evidence_digest,
    open_report,
)
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.mesh_policy import sign_policy
from meshnode.membership.store import DataDir
from meshnode.mesh.validation import MAX_EVIDENCE_PER_FRAME, validate_gossip_frame
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

MESH = "mesh-under-test"
LIAR, WITNESS_A, WITNESS_B, HEAD, OTHER_HEAD = (NodeIdentity.from_seed(bytes([i + 1]) * 32) for i in range(5))
WITNESSES = (WITNESS_A, WITNESS_B)


def test_a_report_of_valid_evidence_opens_naming_the_accused_the_head_and_the_unit():
    evidence = evidence_against(LIAR, WITNESSES)
    held = open_report(report(HEAD, evidence, MESH), mesh_id=MESH)
    assert held.accused == LIAR.node_id and held.reporter == HEAD.node_id
    assert held.unit == (LIAR.node_id, "s", 5, (2, 4))
    assert held.verdict.convicted and held.reported_unix == int(NOW)
    # The digest is the proof's: the same whoever reports it and whenever.
    again = open_report(report(OTHER_HEAD, evidence, MESH, unix_now=NOW + 60), mesh_id=MESH)
    assert held.digest == again.digest == evidence_digest(evidence)


def oversized() -> audit.EvidenceReport:
    return audit.EvidenceReport(body=b"\x0a" * (MAX_REPORT_BODY_BYTES + 1), signature=b"s" * 64)


@pytest.mark.parametrize(
    "make, code",
    [
        # The head's own signature: a report naming HEAD but signed by someone else.
        (
            lambda: badly_signed(HEAD, OTHER_HEAD, evidence_against(LIAR, WITNESSES), MESH),
            "reporter_unsigned",
        ),
        # A head cannot frame a node: the accused's statement signed by the head, not the accused.
        (lambda: report(HEAD, framed(LIAR, HEAD, WITNESSES), MESH), "accused_unsigned"),
        (lambda: report(HEAD, disagreeing(LIAR, WITNESSES), MESH), "witnesses_disagree"),
        (lambda: report(HEAD, evidence_against(LIAR, (WITNESS_A, WITNESS_A)), MESH), "repeated_witness"),
        (lambda: report(HEAD, evidence_against(LIAR, WITNESSES), "another-mesh"), "other_mesh"),
        (lambda: audit.EvidenceReport(body=b"\xff\xff\xff", signature=b"x"), "malformed"),
        # Refused on its size, before anything in it is parsed.
        (oversized, "oversized"),
    ],
)
def test_what_does_not_convict_is_refused_with_its_exact_code_and_never_sent_on(make, code):
    with pytest.raises(ReportRejected) as caught:
        open_report(make(), mesh_id=MESH)
    assert caught.value.code == code
    book = EvidenceBook(MESH)
    learned = book.learn([make()])
    assert learned.new == [] and dict(learned.refused) == {code: 1}
    assert book.signed() == [] and book.accused() == frozenset()
    assert book.to_json()["refused"] == {code: 1}


def test_a_refused_report_sent_again_costs_no_second_check():
    book = EvidenceBook(MESH)
    forged = report(HEAD, framed(LIAR, HEAD, WITNESSES), MESH)
    for _ in range(3):
        book.learn([forged])
    assert book.refused == {"accused_unsigned": 1}


def test_the_first_report_of_a_disputed_unit_stands():
    book = EvidenceBook(MESH)
    evidence = evidence_against(LIAR, WITNESSES)
    first = book.learn([report(HEAD, evidence, MESH)])
    second = book.learn([report(OTHER_HEAD, evidence, MESH)])
    assert [h.reporter for h in first.new] == [HEAD.node_id] and second.new == []
    assert len(book) == 1 and book.accused() == {LIAR.node_id}


def test_a_head_flooding_reports_fills_only_its_own_share():
    book = EvidenceBook(MESH, max_per_reporter=3, max_reports=5, max_checks_per_batch=100)
    flood = [report(HEAD, evidence_against(LIAR, WITNESSES, step=step), MESH) for step in range(10)]
    learned = book.learn(flood)
    assert len(learned.new) == 3 and learned.refused == {OVER_CAP: 7}
    others = [report(OTHER_HEAD, evidence_against(LIAR, WITNESSES, step=100 + s), MESH) for s in range(3)]
    assert len(book.learn(others).new) == 2  # the overall cap: 5
    assert len(book) == 5 and len(book.signed()) == 5


def test_one_batch_verifies_a_bounded_number_of_new_reports():
    book = EvidenceBook(MESH, max_reports=1000, max_per_reporter=1000)
    heads = [NodeIdentity.from_seed(bytes([50 + i]) * 32) for i in range(MAX_CHECKS_PER_BATCH + 5)]
    batch = [report(head, evidence_against(LIAR, WITNESSES, step=i), MESH) for i, head in enumerate(heads)]
    assert len(book.learn(batch).new) == MAX_CHECKS_PER_BATCH
    assert len(book.learn(batch).new) == 5  # the rest on the next frame


def test_a_frame_carries_at_most_what_a_node_keeps():
    assert MAX_EVIDENCE_PER_FRAME == MAX_EVIDENCE_REPORTS
    sender = NodeIdentity.from_seed(b"\x09" * 32).node_id
    frame = mesh.GossipFrame(gen=NODE_PROTOCOL_GENERATION, sender_id=sender)
    frame.evidence.extend([audit.EvidenceReport(body=b"b", signature=b"s")] * MAX_EVIDENCE_PER_FRAME)
    validate_gossip_frame(frame, sender)
    frame.evidence.add(body=b"b", signature=b"s")
    with pytest.raises(MeshRefusal) as caught:
        validate_gossip_frame(frame, sender)
    assert caught.value.code == mesh.MESH_ERROR_MALFORMED


def test_what_a_node_holds_outlives_its_restart_and_is_verified_again(tmp_path):
    mesh_key = MeshKey.from_seed(b"\x07" * 32)
    data_dir = DataDir(tmp_path)
    keeper = EvidenceKeeper(HEAD, mesh_key.mesh_id, data_dir)
    keeper.report(evidence_against(LIAR, WITNESSES))
    policy = sign_policy(mesh_key, issuer_id=HEAD.node_id, unix_now=NOW, quarantine_on_evidence=True)
    assert keeper.control(base64.b64encode(policy.SerializeToString()).decode()) == {"ok": True}
    assert keeper.quarantined() == {LIAR.node_id}

    again = EvidenceKeeper(HEAD, mesh_key.mesh_id, data_dir)
    assert again.quarantined() == {LIAR.node_id} and again.book.signed() == keeper.book.signed()
    assert not again.take_new()  # peers get it on the next frames; nothing to spread at once

    # A file is not trusted more than a peer: a forged report in it is refused at start.
    kept = data_dir.load_evidence()
    kept.reports.append(report(HEAD, framed(LIAR, HEAD, WITNESSES), mesh_key.mesh_id))
    data_dir.save_evidence(kept)
    third = EvidenceKeeper(HEAD, mesh_key.mesh_id, data_dir)
    assert len(third.book) == 1 and third.book.refused == {"accused_unsigned": 1}
