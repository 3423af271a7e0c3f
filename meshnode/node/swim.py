"""SWIM failure detection on the node's links: the asyncio edge of :mod:`meshnode.mesh.failure_detector`.

Under delta gossip a record gets fresher only when its content changes
(``MeshState(record_heartbeats=False)``), so a quiet record says nothing about its node's
liveness; instead, each heartbeat (:meth:`SwimLiveness.round`):

* one member, in the detector's shuffled turn, is probed (a PROBE echo, with the second
  chances :class:`~meshnode.node.reachability.Reachability` gives), and so are those whose
  suspicion others passed us; a member whose digest exchange failed is probed at once
  (:meth:`SwimLiveness.check`);
* a probe left unanswered asks ``indirect_probes`` other members to probe it for us (a PROBE
  naming a ``target``; :meth:`SwimLiveness.probe_for` is the helper's side); only when none
  of them reaches it either is it suspected, and the suspicion rides on our digest frames;
* a suspect removed is one not heard from for the detector's ``suspicion_rounds``: hearing it
  means a probe it answered, a digest exchange with it, or a fresher record of it, signed by
  itself (a suspect that hears itself named on a frame makes its record fresher: SWIM's
  refutation, and the only way a member we cannot reach tells us it is alive);
* a member removed wrongly (alive, but our probes and the helpers' failed) keeps its record,
  which cannot beat its tombstone by itself; when it talks to us again (its view takes us
  back, a first frame admits it) the digest frames we send it name it as suspected
  (:meth:`MeshState.removed_as_down`), it refutes as above, and its fresher record, from
  itself, admits it again at once. A removed node that left, or that an admin revoked, is
  never named.

A suspicion heard is never believed: it makes the hearer probe the suspect itself
(:meth:`FailureDetector.heard`), as a PEER_DOWN report does under full gossip.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable

from meshnode.identity import short_id
from meshnode.mesh.failure_detector import FailureDetector
from meshnode.mesh.message_reader import read_message
from meshnode.mesh.peer_table import MergeReport
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import MAX_SUSPECTED_PER_FRAME, decode, validate_probe
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.liveness import Liveness
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.node.reachability import Reachability
from meshnode.transport.base import PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION, StreamType
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

GetLink = Callable[[bytes], Awaitable[PeerLink]]


class SwimLiveness:
    def __init__(
        self,
        state: MeshState,
        liveness: Liveness,
        reachability: Reachability,
        get_link: GetLink,
        background: BackgroundTasks,
        *,
        probe_timeout: float,
        connect_timeout: float,
        detector: FailureDetector | None = None,
    ) -> None:
        self._state = state
        self._liveness = liveness
        self._reachability = reachability
        self._get_link = get_link
        self._background = background
        self._probe_timeout = probe_timeout
        # A helper's answer waits for its own probe and second chance, and our link to it.
        self._indirect_timeout = connect_timeout + 2 * probe_timeout
        self.detector = detector or FailureDetector(state.node_id)
        # Called with each member removed as confirmed down (the partial view forgets it).
        self.on_removed: Callable[[bytes], None] = lambda _peer_id: None
        self._probing: set[bytes] = set()
        # Peers we probe for others (indirect probes), and how many such probes each.
        self._helping: dict[bytes, int] = {}
        # Rounds run, and the times this node heard itself suspected and made its record fresher.
        self.rounds = 0
        self.refutations = 0

    def round(self) -> None:
        """A heartbeat's failure detection: remove the confirmed, probe this round's member and
        those others suspect."""
        self.rounds += 1
        members = set(self._state.table.peer_ids())
        plan = self.detector.start_round(members)
        for peer_id in plan.confirmed:
            self.confirm_down(peer_id)
        for probed in (plan.probe, *plan.checks):
            if probed is not None:
                self.check(probed)

    def confirm_down(self, peer_id: bytes) -> None:
        """Remove ``peer_id``, a suspect not heard from for the detector's suspicion rounds: out of
        the table (tombstoned), its link closed, and out of the partial view."""
        rounds = self.detector.suspicion_rounds
        if self._liveness.drop(peer_id, f"suspected, and not heard from in {rounds} rounds"):
            self.on_removed(peer_id)

    def check(self, peer_id: bytes) -> None:
        """Probe ``peer_id`` now (its turn, a suspicion heard, a failed exchange), unless a probe
        of it is under way."""
        if peer_id in self._probing or peer_id not in self._state.table:
            return
        self._probing.add(peer_id)
        self._background.spawn(self._probe(peer_id))

    async def _probe(self, peer_id: bytes) -> None:
        try:
            if await self._reachability.reachable(peer_id, self._probe_timeout):
                self.detector.alive(peer_id)
                return
            helpers = self.detector.helpers_for(peer_id, self._state.table.peer_ids())
            answers = await asyncio.gather(*(self._ask(helper, peer_id) for helper in helpers))
            if any(answers):
                log.info("peer %s did not answer our probe but answered another member's", short_id(peer_id))
                self.detector.alive(peer_id)
            elif peer_id in self._state.table and peer_id not in self.detector.suspects:
                log.info(
                    "suspect peer %s: no answer to our probe nor to %d members' probes",
                    short_id(peer_id),
                    len(helpers),
                )
                self.detector.unreachable(peer_id)
        finally:
            self._probing.discard(peer_id)

    async def _ask(self, helper_id: bytes, target_id: bytes) -> bool:
        """Whether ``helper_id`` reached ``target_id`` when asked to probe it for us."""
        nonce = os.urandom(16)
        request = mesh.Probe(gen=NODE_PROTOCOL_GENERATION, nonce=nonce, target=target_id)
        try:
            async with asyncio.timeout(self._indirect_timeout):
                link = await self._get_link(helper_id)
                data = await request_reply(link, StreamType.PROBE, request.SerializeToString(), timeout=None)
            if data is None:
                return False
            echo = decode(mesh.Probe, data)
        except PEER_FAILURES as exc:
            log.debug("indirect probe through %s failed: %s", short_id(helper_id), exc or type(exc).__name__)
            return False
        return echo.nonce == nonce and bytes(echo.target) == target_id and echo.reached

    async def serve_probe(self, stream: FramedStream) -> None:
        """PROBE: echoed at once; one naming a ``target`` once we probed it (an indirect probe)."""
        probe = await read_message(stream, mesh.Probe, self._probe_timeout)
        validate_probe(probe)
        if probe.target:
            probe.reached = await self.probe_for(stream.peer_id, bytes(probe.target))
        await stream.send_frame(probe.SerializeToString())

    async def probe_for(self, requester_id: bytes, target_id: bytes) -> bool:
        """The helper's side of an indirect probe: whether ``target_id``, a member we know, answers us."""
        if target_id == self._state.node_id:
            return True
        if target_id == requester_id or target_id not in self._state.table:
            return False
        self._helping[target_id] = self._helping.get(target_id, 0) + 1
        try:
            reached = await self._reachability.reachable(target_id, self._probe_timeout)
        finally:
            self._helping[target_id] -= 1
            if not self._helping[target_id]:
                del self._helping[target_id]
        if reached:
            self.detector.alive(target_id)
        return reached

    @property
    def probing(self) -> frozenset[bytes]:
        """The peers a probe of ours, or one we make for another member, is under way to."""
        return frozenset(self._probing) | frozenset(self._helping)

    # -- what rides on gossip ---------------------------------------------------------------

    def rumors(self, to: bytes) -> list[bytes]:
        """The suspicions to put on a digest frame we send to ``to`` now: first ``to`` itself when
        we removed it as confirmed down (:meth:`MeshState.removed_as_down`). It talks to us, so
        our probes were wrong; hearing itself named it refutes, and its fresher record, which
        it sends us on this exchange or its next, admits it again."""
        told = [to] if self._state.removed_as_down(to) else []
        return told + self.detector.rumors(MAX_SUSPECTED_PER_FRAME - len(told))

    def heard(self, suspected: Iterable[bytes], *, sender: bytes) -> bool:
        """Suspicions a peer sent on a digest frame: ours to check, or, naming us, to refute;
        whether we refuted (our record is fresher now)."""
        suspected = list(suspected)
        refuted = self._state.node_id in suspected
        if refuted:
            self._state.heartbeat()
            self.refutations += 1
            log.info("peer %s suspects this node, or removed it; our record is fresher now", short_id(sender))
        self.detector.heard(suspected, sender=sender)
        return refuted

    def heard_from(self, peer_id: bytes, report: MergeReport) -> None:
        """A digest exchange with ``peer_id`` completed, and these records were fresher: each of
        their nodes, and the peer, is alive."""
        self.detector.alive(peer_id)
        for node_id in (*report.added, *report.updated):
            self.detector.alive(node_id)


__all__ = ["SwimLiveness"]
