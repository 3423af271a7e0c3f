"""The node's side of audit evidence: reports kept, put on every gossip frame, and spread at once.

The rules are :mod:`meshnode.audit.evidence_book`'s (pure): every report is verified in full
before it is kept, and only kept ones are sent on. This edge:

* puts the reports it holds on every GossipFrame this node sends (not on refusals), so a node
  that joins or reconnects learns them on its first exchange, under full or delta gossip;
* takes the reports of a frame once the frame itself was accepted (its sender admitted), and
  says whether any was new: :class:`~meshnode.node.gossip.Gossip` then gossips with every
  peer at once, as it does for revocations;
* signs a report when this node's own head convicts (:meth:`EvidenceKeeper.report`);
* answers which nodes kept evidence convicts (:meth:`EvidenceKeeper.accused`): the head's
  routes leave them out (:class:`meshnode.head.environment.NodeRoutes`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from meshnode.audit.evidence_book import EvidenceBook
from meshnode.audit.evidence_report import sign_report
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.identity import NodeIdentity, short_id
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


class EvidenceKeeper:
    def __init__(self, identity: NodeIdentity, mesh_id: str, book: EvidenceBook | None = None) -> None:
        self._identity = identity
        self._mesh_id = mesh_id
        self.book = book if book is not None else EvidenceBook(mesh_id)
        # Learned since the last take_new(): what makes gossip spread at once.
        self._new = False
        self._refusal_log = RateLimitedLog(log)

    def attach(self, frame: mesh.GossipFrame) -> mesh.GossipFrame:
        frame.evidence.extend(self.book.signed())
        return frame

    def learn(self, reports: Iterable[audit.EvidenceReport], sender: bytes) -> None:
        learned = self.book.learn(reports)
        for held in learned.new:
            if sender == self._identity.node_id:
                log.warning("gossiping this head's evidence against %s", short_id(held.accused))
                continue
            log.warning(
                "learned audit evidence from %s (reported by %s): %s is no longer routed through; %s",
                short_id(sender),
                short_id(held.reporter),
                short_id(held.accused),
                held.verdict.detail,
            )
        for code, count in learned.refused.items():
            self._refusal_log.log(
                logging.WARNING, "refused %d evidence report(s) from %s: %s", count, short_id(sender), code
            )
        self._new = self._new or bool(learned.new)

    def report(self, evidence: audit.AuditEvidence) -> None:
        """This node's head convicted: the evidence, signed by this node, kept and spread."""
        signed = sign_report(self._identity, evidence, mesh_id=self._mesh_id, unix_now=time.time())
        self.learn([signed], self._identity.node_id)

    def take_new(self) -> bool:
        new, self._new = self._new, False
        return new

    def accused(self) -> frozenset[bytes]:
        return self.book.accused()

    def status_json(self) -> dict[str, Any]:
        return self.book.to_json()


__all__ = ["EvidenceKeeper"]
