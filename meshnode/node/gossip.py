"""Gossip on the node's links: the exchange of GossipFrames, what an exchange taught spread at
once, and the rounds of exchanges the heartbeat asks for.

What a frame means is :class:`~meshnode.mesh.state.MeshState`'s (pure); :class:`Gossip` is
its asyncio edge:

* :meth:`Gossip.exchange` sends our frame on a new stream and takes the reply (the opening
  side) and :meth:`Gossip.serve` answers one (the accepting side); either marks the link
  exchanged (mutual admission), which :meth:`Gossip.get_link` waits for before it hands a
  link out;
* every frame it sends (refusals aside) carries the audit evidence this node holds, and the
  evidence of every frame it accepts is verified and kept
  (:class:`~meshnode.node.evidence_keeper.EvidenceKeeper`); new evidence spreads at once too;
* after every exchange, and when a relay or the control socket handed over a revocation,
  what the :class:`~meshnode.node.membership_keeper.MembershipKeeper` took from the state
  spreads at once: to every relay and every peer (so the whole mesh knows within one
  exchange per link, not one heartbeat per hop), and one last frame to a removed peer,
  which carries the revocation that names it, before its link is closed;
* :meth:`Gossip.with_all` gossips with every peer in the table and
  :meth:`Gossip.with_known_peers` with the stored ones, one exchange at a time per peer; a
  peer that does not answer a round is suspected (:class:`~meshnode.node.liveness.Liveness`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import short_id
from meshnode.membership.credentials import Endpoint
from meshnode.membership.revocation import Revoked
from meshnode.mesh.message_reader import read_message
from meshnode.mesh.peer_table import MergeReport
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import decode, validate_route_request
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.node.liveness import Liveness
from meshnode.node.membership_keeper import MembershipKeeper
from meshnode.node.peer_connections import PeerConnections
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.base import LinkClosed, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal, in_words
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

_LINK_ATTEMPTS = 3
# How long the last frame to a removed peer may take before its link is closed anyway.
_FAREWELL_TIMEOUT_S = 2.0


def _exchanged_ok(done: asyncio.Future[None] | None) -> bool:
    """Whether a gossip exchange on a link completed (a cancelled one, its caller timed out,
    proves nothing)."""
    return done is not None and done.done() and not done.cancelled() and done.exception() is None


class Gossip:
    def __init__(
        self,
        state: MeshState,
        keeper: MembershipKeeper,
        connections: PeerConnections,
        liveness: Liveness,
        background: BackgroundTasks,
        known_peers: list[Endpoint],
        *,
        gossip_timeout: float,
        connect_timeout: float,
        evidence: EvidenceKeeper,
    ) -> None:
        """``known_peers``: the node's peers to dial by address besides the table's; ``evidence``:
        the audit evidence this node holds and spreads."""
        self._state = state
        self._keeper = keeper
        self.evidence = evidence
        self._connections = connections
        self._liveness = liveness
        self._background = background
        self._known_peers = known_peers
        self._gossip_timeout = gossip_timeout
        self._connect_timeout = connect_timeout
        # What revocations spread to, once the node has registered with its relays (start).
        self._relay_links: RelayLinks | None = None
        # Per link, the exchange that admitted it, or the first one under way on it.
        self._exchanged: dict[PeerLink, asyncio.Future[None]] = {}
        # Peers a round's exchange is under way with (a heartbeat's, or a known peer's dial).
        self._in_round: set[bytes] = set()
        # Gossip frames refused, by code name (the status report's refusals.gossip).
        self._refusals: dict[str, int] = {}
        self._refusal_log = RateLimitedLog(log)
        # How what this node learned reaches its peers at once: an exchange with each (under
        # delta gossip the node sets a digest round with its view instead).
        self.spread: Callable[[], None] = self.with_all
        # How new audit evidence does: it rides GossipFrames only, never digests, so under delta
        # gossip the node sets a frame exchange with its active view here.
        self.spread_evidence: Callable[[], None] = self.with_all

    def start(self, relay_links: RelayLinks) -> None:
        """Spread revocations to ``relay_links`` too, from now on."""
        self._relay_links = relay_links

    @property
    def refusals(self) -> Mapping[str, int]:
        """Gossip frames refused, by code name."""
        return MappingProxyType(self._refusals)

    @property
    def in_round(self) -> frozenset[bytes]:
        """The peers a round's exchange is under way with."""
        return frozenset(self._in_round)

    # -- links on which gossip completed -------------------------------------------------

    async def get_link(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink:
        """A live link to ``peer_id`` on which a gossip exchange (mutual admission) completed;
        a new link does not go through ``avoid_relays``."""
        for attempt in range(_LINK_ATTEMPTS):
            link = await self._connections.connect(peer_id, avoid_relays)
            try:
                if not _exchanged_ok(self._exchanged.get(link)):
                    await self.exchange(link)
            except LinkClosed:
                # Lost a simultaneous-dial tie-break (or died): the survivor, or a new dial, is next.
                if attempt == _LINK_ATTEMPTS - 1:
                    raise
                continue
            return link
        raise AssertionError("unreachable")

    def link_closed(self, link: PeerLink) -> None:
        self._exchanged.pop(link, None)

    # -- the exchange ----------------------------------------------------------------------

    async def exchange(self, link: PeerLink) -> None:
        """Send our GossipFrame on a new stream and take the reply (opening side)."""
        done = asyncio.get_running_loop().create_future()
        if not _exchanged_ok(self._exchanged.get(link)):
            # Not a heartbeat's on a link already exchanged: get_link would wait for it.
            self._exchanged[link] = done
        try:
            frame = self.evidence.attach(self._state.gossip_frame(link.peer_id)).SerializeToString()
            data = await request_reply(link, StreamType.GOSSIP, frame, timeout=self._gossip_timeout)
            if data is None:
                raise MeshRefusal(mesh.MESH_ERROR_PROTOCOL, "gossip stream ended without a reply")
            was_member = self._state.is_member
            reply = decode(mesh.GossipFrame, data)
            outcome = self._state.receive_gossip_reply(
                reply,
                peer_id=link.peer_id,
                now_ns=time.monotonic_ns(),
                unix_now=time.time(),
            )
            # Only from a reply the state accepted: its sender is an admitted member.
            self.evidence.take(reply, link.peer_id)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: callers see `exc` re-raised below
            self.spread_learned()
            if isinstance(exc, RemoteRefusal):
                self._keeper.remote_refused(exc)
            raise
        done.set_result(None)
        self.spread_learned()
        if outcome.renewed:
            log.info("membership certificate renewed by %s", short_id(link.peer_id))
            self._keeper.save_membership()
        if outcome.joined and not was_member:
            log.info(
                "admitted to mesh %s by %s; stored membership certificate",
                self._state.mesh_id,
                short_id(link.peer_id),
            )
        if outcome.newly_admitted:
            log.info("admitted peer %s (member certificate)", short_id(link.peer_id))
        self._log_merge(outcome.merged, link.peer_id)

    async def serve(self, stream: FramedStream) -> None:
        """Answer a peer's GossipFrame (accepting side)."""
        frame = await read_message(stream, mesh.GossipFrame, self._gossip_timeout)
        peer_id = stream.peer_id
        try:
            outcome = self._state.receive_gossip(
                frame, peer_id=peer_id, now_ns=time.monotonic_ns(), unix_now=time.time()
            )
        except MeshRefusal as refusal:
            self._refusals[refusal.code_name] = self._refusals.get(refusal.code_name, 0) + 1
            self._refusal_log.log(
                logging.INFO,
                "refused gossip from %s: %s",
                short_id(peer_id),
                in_words(refusal.code, refusal.detail),
            )
            self.spread_learned()
            await stream.send_frame(self._state.refusal_frame(refusal).SerializeToString())
            return
        self.evidence.take(frame, peer_id)
        self.spread_learned()
        if outcome.invite_id:
            self._keeper.invite_used(outcome.invite_id, peer_id)
        if outcome.newly_admitted:
            how = "invite" if outcome.via_invite else "member certificate"
            log.info("admitted peer %s (%s)", short_id(peer_id), how)
        self._log_merge(outcome.merged, peer_id)
        await stream.send_frame(self.evidence.attach(outcome.reply).SerializeToString())
        link = self._connections.links.get(peer_id)
        if link is not None and link not in self._exchanged:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self._exchanged[link] = done

    async def serve_route_request(self, stream: FramedStream) -> None:
        """Answer a RouteTableRequest with the route table our gossip built."""
        request = await read_message(stream, mesh.RouteTableRequest, self._gossip_timeout)
        validate_route_request(request, stream.peer_id)
        await stream.send_frame(self._state.route_table().SerializeToString())

    def _log_merge(self, report: MergeReport, source: bytes) -> None:
        for drop in report.dropped:  # counted in state.record_drops
            self._refusal_log.log(logging.WARNING, "dropped a %s sent by %s", drop, short_id(source))
        for peer_id in report.added:
            how = "" if peer_id == source else f" (via {short_id(source)})"
            log.info("peer %s joined our view%s", short_id(peer_id), how)
        if report.ignored_full:
            log.warning(
                "peer table full (%d members, --max-peers): ignored the records of %d new ones",
                self._state.table.max_peers,
                len(report.ignored_full),
            )

    # -- what an exchange taught, spread ---------------------------------------------------

    def spread_learned(self) -> None:
        """Spread what the keeper took from the state (a gossip exchange's, a relay's or the control
        socket's revocations): to every relay and every peer at once, and one last frame to a
        removed peer, which carries the revocation that names it, before its link is closed. New
        audit evidence spreads to every peer at once too."""
        learned = self._keeper.after_gossip()
        new_evidence = self.evidence.take_new()
        if not learned and not new_evidence:
            return
        if learned and self._relay_links is not None:
            self._relay_links.publish_revocations([revoked.signed for revoked in learned])
        for revoked in learned:
            if revoked.kind == "node" and revoked.target != self._state.node_id:
                link = self._connections.links.get(revoked.target)
                if link is not None:
                    self._background.spawn(self._farewell(link, revoked))
        # A set: where both ways are one (full gossip: an exchange with every peer), once.
        ways = {self.spread} if learned else set()
        if new_evidence:
            ways.add(self.spread_evidence)
        for spread in ways:
            spread()

    async def _farewell(self, link: PeerLink, revoked: Revoked) -> None:
        try:
            async with asyncio.timeout(_FAREWELL_TIMEOUT_S):
                await self.exchange(link)
        except Exception as exc:  # its refusal, or its silence, changes nothing now
            log.debug("last frame to removed %s: %s", short_id(revoked.target), exc or type(exc).__name__)
        link.close(f"removed: {revoked.describe()}")

    def revocation_from_relay(self, revocation: membership.Revocation) -> None:
        """A relay refused us with ``revocation``: the keeper's to check, then spread."""
        self._keeper.relayed_revocation(revocation)
        self.spread_learned()

    def control(self, request: str) -> dict[str, Any]:
        """The control socket's requests (the keeper's; a mesh policy the evidence keeper's); a
        revocation or policy it accepted spreads at once."""
        verb, _, argument = request.partition(" ")
        answer = (
            self.evidence.control(argument.strip()) if verb == "policy" else self._keeper.control(request)
        )
        self.spread_learned()
        return answer

    # -- rounds ------------------------------------------------------------------------------

    def with_all(self) -> None:
        """Gossip with every peer in the table (those a round is not under way with already)."""
        for peer_id in self._state.table.peer_ids():
            if peer_id not in self._in_round:
                self._background.spawn(self._with_peer(peer_id))

    def with_known_peers(self) -> None:
        """Gossip with the known peers, dialed by address (while the table lists none)."""
        for endpoint in self._known_peers:
            if endpoint.id != self._state.node_id and endpoint.id not in self._in_round:
                self._background.spawn(self.with_known_peer(endpoint))

    async def _with_peer(self, peer_id: bytes) -> None:
        self._in_round.add(peer_id)
        try:
            async with asyncio.timeout(self._connect_timeout + self._gossip_timeout):
                link = await self._connections.connect(peer_id)
                await self.exchange(link)
        except RemoteRefusal as refusal:
            log.info("peer %s refused our heartbeat: %s", short_id(peer_id), refusal.detail)
        except PEER_FAILURES as exc:
            log.debug("heartbeat to %s failed: %s", short_id(peer_id), exc or type(exc).__name__)
            self._liveness.suspect(peer_id, reporter=None)
        finally:
            self._in_round.discard(peer_id)

    async def with_known_peer(self, endpoint: Endpoint) -> bool:
        """Dial a known peer by its address and gossip with it; whether it answered."""
        self._in_round.add(endpoint.id)
        try:
            link = await self._connections.dial_endpoint(endpoint)
            await self.exchange(link)
            return True
        except PEER_FAILURES as exc:
            log.debug("known peer %s did not answer: %s", endpoint, exc or type(exc).__name__)
            return False
        finally:
            self._in_round.discard(endpoint.id)


__all__ = ["Gossip"]
