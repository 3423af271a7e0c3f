"""The evidence reports one node holds, learned from gossip or from its own audits. Pure.

Every report is opened in full (:func:`meshnode.audit.evidence_report.open_report`) before it
is kept, and only kept ones are ever sent on (:meth:`EvidenceBook.signed`): a report that fails
is counted by its code and goes no further. What one node can make others hold is bounded:

* at most ``max_reports`` reports in all, and ``max_per_reporter`` of any one reporting head,
  so a head (or a member signing as one) that floods reports fills its own share only;
* one report per disputed unit (accused, session, step, layers): the first kept stands;
* at most ``max_checks_per_batch`` reports not seen before are verified from one frame (each
  costs several signature checks); the rest come again on the sender's next frame;
* the exact bytes of reports already judged are remembered (a bounded set), so a frame repeating
  what we hold, or what we refused, costs no signature check.

Nothing is ever forgotten while kept: an admin clears an accused by removing it (its evidence
then names a node that is gone) and a node's restart starts it empty (peers gossip it again).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshnode.audit.evidence_report import (
    DisputedUnit,
    HeldEvidence,
    ReportRejected,
    open_report,
)
from meshnode.gen.meshnode.v1 import audit_pb2 as audit

# What a GossipFrame may carry (meshnode.mesh.validation.MAX_EVIDENCE_PER_FRAME is the same; a
# test holds them equal): every report a node holds goes on every frame.
MAX_EVIDENCE_REPORTS = 64
MAX_PER_REPORTER = 8
MAX_CHECKS_PER_BATCH = 16
# Code counted for a sound report past a cap (not a fault of the report).
OVER_CAP = "over_cap"


@dataclass
class EvidenceLearned:
    """What one batch taught: the reports newly kept, and the refused ones by code."""

    new: list[HeldEvidence] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)


class EvidenceBook:
    def __init__(
        self,
        mesh_id: str,
        *,
        max_reports: int = MAX_EVIDENCE_REPORTS,
        max_per_reporter: int = MAX_PER_REPORTER,
        max_checks_per_batch: int = MAX_CHECKS_PER_BATCH,
    ) -> None:
        self.mesh_id = mesh_id
        self.max_reports = max_reports
        self.max_per_reporter = max_per_reporter
        self.max_checks_per_batch = max_checks_per_batch
        self._by_unit: dict[DisputedUnit, HeldEvidence] = {}
        self._per_reporter: Counter[bytes] = Counter()
        # Digests of report bytes already judged (kept, refused or a repeat): never checked again.
        self._judged: set[bytes] = set()
        # Every refusal since start, by code (the status report's and the tests' reading).
        self.refused: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._by_unit)

    def learn(
        self, reports: Iterable[audit.EvidenceReport], *, max_checks: int | None = None
    ) -> EvidenceLearned:
        """``max_checks``: reports verified from this batch at most (default: the per-frame cap;
        the node's own stored file, at most a book's worth, is read whole)."""
        learned = EvidenceLearned()
        checked = 0
        limit = self.max_checks_per_batch if max_checks is None else max_checks
        for report in reports:
            key = self._judgement_key(report)
            if key in self._judged:
                continue
            checked += 1
            if checked > limit:
                break
            self._remember(key)
            try:
                held = open_report(report, mesh_id=self.mesh_id)
            except ReportRejected as rejected:
                learned.refused[rejected.code] += 1
                continue
            if held.unit in self._by_unit:
                continue  # another report of the same dispute: the first stands
            if len(self._by_unit) >= self.max_reports or (
                self._per_reporter[held.reporter] >= self.max_per_reporter
            ):
                learned.refused[OVER_CAP] += 1
                continue
            self._by_unit[held.unit] = held
            self._per_reporter[held.reporter] += 1
            learned.new.append(held)
        self.refused.update(learned.refused)
        return learned

    def _remember(self, key: bytes) -> None:
        # Bounded: past the limit it starts over, and a report judged again costs one more check.
        if len(self._judged) >= 16 * self.max_reports:
            self._judged = {self._judgement_key(h.signed) for h in self._by_unit.values()}
        self._judged.add(key)

    @staticmethod
    def _judgement_key(report: audit.EvidenceReport) -> bytes:
        return hashlib.sha256(bytes(report.body) + b"\0" + bytes(report.signature)).digest()

    def held(self) -> list[HeldEvidence]:
        return sorted(self._by_unit.values(), key=lambda h: (h.reported_unix, h.digest))

    def signed(self) -> list[audit.EvidenceReport]:
        """What this node sends on: the reports it kept, nothing else."""
        return [held.signed for held in self.held()]

    def accused(self) -> frozenset[bytes]:
        """The nodes some kept evidence convicts."""
        return frozenset(held.accused for held in self._by_unit.values())

    def to_json(self) -> dict[str, object]:
        return {
            "held": [held.to_json() for held in self.held()],
            "refused": dict(sorted(self.refused.items())),
            "limits": {"reports": self.max_reports, "per_reporter": self.max_per_reporter},
        }


__all__ = [
    "MAX_CHECKS_PER_BATCH",
    "MAX_EVIDENCE_REPORTS",
    "MAX_PER_REPORTER",
    "OVER_CAP",
    "EvidenceBook",
    "EvidenceLearned",
]
