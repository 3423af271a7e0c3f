"""Delta gossip on the node's links: the asyncio edge of :mod:`meshnode.mesh.digest_gossip`.

With ``NodeConfig.delta_gossip`` the heartbeat does not exchange the whole table with
every peer: :meth:`DeltaGossip.round` takes ``fanout`` peers of the partial view's active
view (:class:`~meshnode.mesh.partial_view.PartialView`) and runs a digest exchange with
each (four frames on one GOSSIP_DIGEST stream). The first contact with a peer is still a
full GossipFrame exchange (:meth:`Gossip.get_link`), which admits both sides; under
delta gossip that frame carries no table (``MeshState.frame_table_limit``), the digest
brings the rest. What the records and revocations mean, and every check on them, is the
pure machine's.

The node keeps links for gossip only to its active view: each round a link to a peer
outside it that carried no stream at the round before either, nor one its peer opened
since (the reply of a stream we served may still be on its way), is closed
(:func:`~meshnode.mesh.partial_view.links_to_close`), a direct QUIC link or a relayed one
alike (a relayed link's channels are its streams); a link a route's session or a
transfer uses stays, and the data plane makes its links on demand as before. A peer that
closes its link to us leaves our active view for the passive one (it evicted us), and
now and then a round swaps an active peer for a passive one (HyParView's shuffle), so the
views keep mixing and a healed partition's halves meet again.

Liveness does not ride on the records (each changes only when its content does): SWIM
probes find dead members (:class:`~meshnode.node.swim.SwimLiveness`, run at the start of
each round), a peer whose exchange fails is probed at once, and suspicions ride on the
digest frames both ways (``DigestOpen.suspected``, ``DigestReply.suspected``); a frame to a
peer we removed as down while it was alive names that peer, so it refutes
(:meth:`SwimLiveness.rumors`), and the side that refutes sends its fresher record on the
same exchange.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from meshnode.identity import short_id
from meshnode.mesh.digest_gossip import DigestExchangeReport, DigestGossip
from meshnode.mesh.message_reader import read_message
from meshnode.mesh.partial_view import PartialView, links_to_close
from meshnode.mesh.peer_links import PeerLinks
from meshnode.mesh.state import MeshState
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.gossip import Gossip
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.node.swim import SwimLiveness
from meshnode.transport.base import PeerLink, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal, refusal_from_reset_code
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# The chance a round swaps one active peer for a passive one: about every ten rounds.
SHUFFLE_CHANCE = 0.1
# How an evidence frame exchange with a peer can fail: the peer's refusal, or any failure a
# conversation with it can meet.
_FRAME_FAILURES: tuple[type[Exception], ...] = (RemoteRefusal, *PEER_FAILURES)


# A link as a round saw it: the link, the streams its peer had opened on it, the streams open.
_LinkLook = tuple[PeerLink, int, int | None]


def _quiet_since(before: _LinkLook | None, now: _LinkLook) -> bool:
    """The same link, no stream open on it then, and none its peer opened since."""
    return before is not None and before[0] is now[0] and before[1] == now[1] and before[2] == 0


class DeltaGossip:
    def __init__(
        self,
        state: MeshState,
        gossip: Gossip,
        swim: SwimLiveness,
        links: PeerLinks,
        background: BackgroundTasks,
        *,
        fanout: int,
        active_view: int,
        gossip_timeout: float,
        connect_timeout: float,
    ) -> None:
        self._state = state
        self._gossip = gossip
        self.swim = swim
        self._links = links
        self._rng = random.Random()
        self._background = background
        self._fanout = fanout
        self._gossip_timeout = gossip_timeout
        self._connect_timeout = connect_timeout
        self._digest = DigestGossip(state)
        self.view = PartialView(state.node_id, active_size=active_view, passive_size=4 * active_view)
        swim.on_removed = lambda peer_id: self.view.drop(peer_id, failed=True)
        self._in_round: set[bytes] = set()
        # Peers an exchange completed with since this round began: not opened to again in it.
        self._synced: set[bytes] = set()
        # Digest exchanges completed, opened and served (the status report's and the tests' reading).
        self.exchanges = 0
        # Links closed because their peer was outside the active view.
        self.links_closed = 0
        # Each live link as the last round looked at it.
        self._seen_links: dict[bytes, _LinkLook] = {}

    def round(self) -> None:
        """A heartbeat's failure detection, then its gossip: a digest exchange with ``fanout``
        peers of the active view."""
        self.swim.round()
        self.view.refresh(set(self._state.table.peer_ids()))
        if self._rng.random() < SHUFFLE_CHANCE:
            swapped = self.view.shuffle()
            if swapped is not None:
                log.debug("%s swapped out of our active view for %s", *map(short_id, swapped))
        self._close_links_outside_view()
        synced, self._synced = self._synced, set()
        for peer_id in self.view.targets(self._fanout, synced):
            if peer_id not in self._in_round:
                self._background.spawn(self._with_peer(peer_id))

    def gossip_now(self) -> None:
        """A digest exchange with ``fanout`` peers of the active view at once (this node learned a
        revocation, which the digests carry by id), whether or not they synced this round."""
        for peer_id in self.view.targets(self._fanout):
            if peer_id not in self._in_round:
                self._background.spawn(self._with_peer(peer_id))

    def evidence_now(self) -> None:
        """New audit evidence rides GossipFrames, which digests do not carry: a frame exchange with
        every peer of the active view at once (a handful); each of them, the evidence new to it,
        does the same with its own view, so it crosses the mesh as the views connect it."""
        for peer_id in self.view.active:
            self._background.spawn(self._frame_with(peer_id))

    async def _frame_with(self, peer_id: bytes) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout + 2 * self._gossip_timeout):
                link = await self._gossip.get_link(peer_id)
                await self._gossip.exchange(link)
        except _FRAME_FAILURES as exc:
            # The next evidence-bearing frame (a first contact, another peer's spread) carries it too.
            log.debug("evidence frame to %s failed: %s", short_id(peer_id), exc or type(exc).__name__)

    def _close_links_outside_view(self) -> None:
        live = self._links.live()
        stream_counts = {link.peer_id: link.stream_count for link in live}
        seen, self._seen_links = (
            self._seen_links,
            {link.peer_id: (link, link.streams_accepted, link.stream_count) for link in live},
        )
        quiet = {peer_id for peer_id, now in self._seen_links.items() if _quiet_since(seen.get(peer_id), now)}
        busy = self._in_round | self.swim.probing
        for peer_id in links_to_close(stream_counts, self.view.active, busy, quiet):
            link = self._links.get(peer_id)
            if link is not None:
                self.links_closed += 1
                link.close("outside the active view")

    def link_closed(self, peer_id: bytes) -> None:
        """The link kept to ``peer_id`` closed (it evicted us, or we it): out of the active view."""
        if peer_id in self.view.active:
            self.view.drop(peer_id, failed=False)

    async def _with_peer(self, peer_id: bytes) -> None:
        self._in_round.add(peer_id)
        try:
            async with asyncio.timeout(self._connect_timeout + 2 * self._gossip_timeout):
                link = await self._gossip.get_link(peer_id)
                await self.exchange(link)
        except RemoteRefusal as refusal:
            log.info("peer %s refused our digest: %s", short_id(peer_id), refusal.detail)
        except MeshRefusal as refusal:
            log.info("refused the digest reply of %s: %s", short_id(peer_id), refusal.detail)
        except PEER_FAILURES as exc:
            log.debug("digest with %s failed: %s", short_id(peer_id), exc or type(exc).__name__)
            self.view.drop(peer_id, failed=True)
            # A failed exchange is a failed probe: probe again, and ask others, before suspecting.
            self.swim.check(peer_id)
        finally:
            self._in_round.discard(peer_id)

    async def exchange(self, link: PeerLink) -> DigestExchangeReport:
        """The opening side: our digest, their versions, our push and wants, their records."""
        peer_id = link.peer_id
        async with asyncio.timeout(self._gossip_timeout):
            stream = await link.open_stream(StreamType.GOSSIP_DIGEST)
            try:
                sent = self._digest.open()
                sent.suspected.extend(self.swim.rumors(peer_id))
                await stream.send_frame(sent.SerializeToString())
                reply = await read_message(stream, mesh.DigestReply, None)
                push = self._digest.answer_reply(sent, reply, peer_id=peer_id)
                if self.swim.heard(reply.suspected, sender=peer_id):
                    # It suspects us, or removed us: our push carries the fresher record at once.
                    push = self._digest.answer_reply(sent, reply, peer_id=peer_id)
                await stream.send_frame(push.SerializeToString())
                stream.finish()
                records = await read_message(stream, mesh.DigestRecords, None)
            except StreamReset as exc:
                refusal = refusal_from_reset_code(exc.error_code)
                if refusal is not None:
                    raise refusal from None
                raise
            finally:
                stream.close()
        report = self._digest.take_records(
            records, peer_id=peer_id, now_ns=time.monotonic_ns(), unix_now=time.time()
        )
        self._after(peer_id, report)
        return report

    async def serve(self, stream: FramedStream) -> None:
        """The accepting side (GOSSIP_DIGEST, from admitted peers only: the dispatcher's rule)."""
        peer_id = stream.peer_id
        opened = await read_message(stream, mesh.DigestOpen, self._gossip_timeout)
        reply = self._digest.answer_open(opened, peer_id=peer_id)
        if self.swim.heard(opened.suspected, sender=peer_id):
            # Our reply lists the fresher record, which a peer that removed us asks for at once.
            reply = self._digest.answer_open(opened, peer_id=peer_id)
        reply.suspected.extend(self.swim.rumors(peer_id))
        await stream.send_frame(reply.SerializeToString())
        push = await read_message(stream, mesh.DigestPush, self._gossip_timeout)
        records, report = self._digest.answer_push(
            push, peer_id=peer_id, now_ns=time.monotonic_ns(), unix_now=time.time()
        )
        await stream.send_frame(records.SerializeToString())
        self._after(peer_id, report)

    def _after(self, peer_id: bytes, report: DigestExchangeReport) -> None:
        self.exchanges += 1
        self._synced.add(peer_id)
        self.swim.heard_from(peer_id, report.merged)
        evicted = self.view.accept(peer_id)
        if evicted is not None:
            log.debug("%s left our active view for %s", short_id(evicted), short_id(peer_id))
        for added in report.merged.added:
            log.info("peer %s joined our view (via %s)", short_id(added), short_id(peer_id))
        if report.merged.ignored_full:
            log.warning(
                "peer table full (%d members, --max-peers): ignored the records of %d new ones",
                self._state.table.max_peers,
                len(report.merged.ignored_full),
            )
        # Revocations learned spread as the full gossip's do.
        self._gossip.spread_learned()


__all__ = ["DeltaGossip"]
