"""The node's side of audit evidence: reports kept, put on every gossip frame, and spread at once;
and the admin-signed mesh policy that says what the node does about them.

The rules are :mod:`meshnode.audit.evidence_book`'s and :mod:`meshnode.membership.mesh_policy`'s
(pure): every report is verified in full before it is kept, and only kept ones are sent on; a
policy stands once the mesh key's signature checks out. This edge:

* puts the reports it holds on every GossipFrame this node sends (not on refusals), so a node
  that joins or reconnects learns them on its first exchange, under full or delta gossip;
* takes the reports of a frame once the frame itself was accepted (its sender admitted), and
  says whether any was new: :class:`~meshnode.node.gossip.Gossip` then gossips with every
  peer at once, as it does for revocations;
* signs a report when this node's own head convicts (:meth:`EvidenceKeeper.report`);
* answers which nodes the head's routes leave out (:meth:`EvidenceKeeper.excluded`: those kept
  evidence convicts, less those an admin's policy cleared; :class:`meshnode.head.environment.NodeRoutes`)
  and which placement ignores too (:meth:`EvidenceKeeper.quarantined`: the same, where the policy
  says to quarantine on evidence; :mod:`meshnode.autoplace.auto_shard`);
* answers what the policy asks of this node's served hop (:mod:`meshnode.dataplane.hop_rules`);
* takes the policy an admin hands the control socket (``policy BASE64``, ``meshnode policy``);
* keeps what it holds in the data directory (``evidence.pb``), verified again at start, so a
  quarantine outlives a restart of the whole mesh.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Iterable
from typing import Any

from meshnode.audit.evidence_book import EvidenceBook
from meshnode.audit.evidence_report import sign_report
from meshnode.gen.meshnode.v1 import audit_pb2 as audit
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.mesh_policy import PolicyHolder
from meshnode.membership.store import DataDir, StoreError
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


class EvidenceKeeper:
    def __init__(self, identity: NodeIdentity, mesh_id: str, data_dir: DataDir | None = None) -> None:
        """``data_dir``: where what it holds is kept across restarts (None: nowhere)."""
        self._identity = identity
        self._mesh_id = mesh_id
        self._data_dir = data_dir
        self.book = EvidenceBook(mesh_id)
        self.policy = PolicyHolder(mesh_id)
        # Learned since the last take_new(): what makes gossip spread at once.
        self._new = False
        self._refusal_log = RateLimitedLog(log)
        self._load()

    def _load(self) -> None:
        if self._data_dir is None:
            return
        try:
            kept = self._data_dir.load_evidence()
        except (StoreError, OSError) as exc:
            log.warning("%s; starting with none (peers will gossip it again)", exc)
            return
        learned = self.book.learn(kept.reports, max_checks=len(kept.reports))
        if learned.refused:
            log.warning("ignored stored evidence reports that do not verify: %s", dict(learned.refused))
        if kept.HasField("policy"):
            self.policy.learn(kept.policy)
        self._new = False  # nothing to spread at once: peers get it on the next frames

    def _save(self) -> None:
        if self._data_dir is None:
            return
        kept = audit.KeptEvidence(reports=self.book.signed())
        if self.policy.current is not None:
            kept.policy.CopyFrom(self.policy.current.signed)
        try:
            self._data_dir.save_evidence(kept)
        except OSError as exc:
            log.warning("could not save audit evidence: %s", exc)

    def attach(self, frame: mesh.GossipFrame) -> mesh.GossipFrame:
        frame.evidence.extend(self.book.signed())
        if self.policy.current is not None:
            frame.policy.CopyFrom(self.policy.current.signed)
        return frame

    def take(self, frame: mesh.GossipFrame, sender: bytes) -> None:
        """What a frame the state accepted (its sender admitted) carries: evidence and policy."""
        self.learn(frame.evidence, sender)
        if frame.HasField("policy"):
            self.learn_policy(frame.policy)

    def learn_policy(self, signed: membership.MeshPolicy) -> bool:
        if not self.policy.learn(signed):
            return False
        assert self.policy.current is not None
        log.warning(
            "mesh policy by admin %s: %s", short_id(self.policy.current.issuer_id), self.policy.to_json()
        )
        self._new = True
        self._save()
        return True

    def control(self, text: str) -> dict[str, Any]:
        """``policy BASE64``'s argument: a signed MeshPolicy, kept and spread once it verifies."""
        try:
            signed = membership.MeshPolicy.FromString(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            return {"error": "not a mesh policy"}
        before = self.policy.current
        if not self.learn_policy(signed) and (before is None or before.signed != signed):
            return {"error": "the policy does not verify for this mesh, or a newer one stands"}
        return {"ok": True}

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
        if learned.new:
            self._new = True
            self._save()

    def report(self, evidence: audit.AuditEvidence) -> None:
        """This node's head convicted: the evidence, signed by this node, kept and spread."""
        signed = sign_report(self._identity, evidence, mesh_id=self._mesh_id, unix_now=time.time())
        self.learn([signed], self._identity.node_id)

    def take_new(self) -> bool:
        new, self._new = self._new, False
        return new

    def accused(self) -> frozenset[bytes]:
        return self.book.accused()

    def excluded(self) -> frozenset[bytes]:
        """The nodes this node's head routes through no more: accused, and not cleared by an admin."""
        return self.book.accused() - self.policy.cleared()

    def quarantined(self) -> frozenset[bytes]:
        """The nodes placement ignores too: the excluded, where the mesh policy quarantines."""
        return self.excluded() if self.policy.quarantines() else frozenset()

    def requires_handoffs(self) -> bool:
        """Whether the mesh policy requires handoffs (meshnode.dataplane.hop_rules)."""
        return self.policy.requires_handoffs()

    def status_json(self) -> dict[str, Any]:
        """The evidence held (each verified; marked where quarantined), the reports refused by
        code, the caps, and the mesh policy in force."""
        quarantined = self.quarantined()
        return {
            **self.book.to_json(),
            "held": [{**h.to_json(), "quarantined": h.accused in quarantined} for h in self.book.held()],
            "policy": self.policy.to_json(),
            "policy_refused": dict(self.policy.refused),
        }


__all__ = ["EvidenceKeeper"]
