"""One hole-punching attempt over a relayed link: the initiator's half and the responder's.

The exchange is traversal.proto's (DCUtR's timing): the initiator times the round trip of the
offers, sends the sync, and half a round trip later (when the sync reaches the responder) sends
punch datagrams to the responder's candidates, opening its own NAT for what comes back; the
responder, on the sync, sends punch datagrams too and dials the initiator's candidates over QUIC
from the node's socket, expecting the initiator's key. The first dial that completes is handed
to the node as a link like any other (its rule keeps a direct link over a relayed one); the
others are closed.

A punch datagram is one byte QUIC cannot parse (a short header with the fixed bit clear): a
meshnode endpoint drops it unread; it exists only to make the sender's NAT expect the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshnode.gen.meshnode.v1 import traversal_pb2 as traversal
from meshnode.identity import short_id
from meshnode.transport.base import LinkHandler, MeshStream, PeerLink, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import DialError, QuicEndpoint, QuicLink
from meshnode.transport.udp_address import describe_sockaddr
from meshnode.traversal import punch_messages
from meshnode.traversal.config import PunchTiming
from meshnode.wire.errors import FramingError
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# QUIC drops it: a short header whose fixed bit is clear (RFC 9000 section 17.3).
PUNCH_DATAGRAM = b"\x00"


class PunchOutcome(enum.Enum):
    DIRECT = "direct"  # a direct link came up
    FAILED = "failed"  # the exchange went through, no direct link did
    DECLINED = "declined"  # one side said no (the reason says why)
    ERROR = "error"  # the exchange itself broke (stream lost, refused, timed out)


@dataclass(frozen=True)
class PunchReport:
    outcome: PunchOutcome
    detail: str
    reached: str = ""
    rtt_s: float | None = None
    decline_reason: traversal.PunchDeclineReason = traversal.PUNCH_DECLINE_UNSPECIFIED
    retry_after_s: float = 0.0
    link: PeerLink | None = None


@dataclass(frozen=True)
class Decline:
    reason: traversal.PunchDeclineReason
    detail: str
    retry_after_s: float = 0.0


class FirstLinkWins:
    """The handler of one attempt's dials: the first link to complete goes to the node's handler
    (and its events from then on); any later one is closed before the node sees it."""

    def __init__(self, node: LinkHandler) -> None:
        self._node = node
        self.chosen: QuicLink | None = None
        self.chosen_event = asyncio.Event()

    def link_established(self, link: PeerLink) -> None:
        assert isinstance(link, QuicLink)
        if self.chosen is not None:
            link.close("another punch candidate answered first")
            return
        self.chosen = link
        link.handler = self._node
        self.chosen_event.set()
        self._node.link_established(link)

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        stream.reset(mesh.MESH_ERROR_PROTOCOL)  # only a link not chosen gets here

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass  # the node never knew a link not chosen


class Puncher:
    """Runs punch attempts from the node's socket. ``own_offer()`` is what this node offers now
    (candidates, NatMapping); ``targets(peer, offered)`` which of a peer's offered candidates to
    send to (those its own signed record announces, and that can lead somewhere from here);
    ``direct_link(peer)`` the direct link kept to it, if any."""

    def __init__(
        self,
        endpoint: QuicEndpoint,
        node: LinkHandler,
        *,
        own_offer: Callable[[], tuple[Sequence[str], mesh.NatMapping]],
        targets: Callable[[bytes, Sequence[str]], list[str]],
        direct_link: Callable[[bytes], PeerLink | None],
        timing: PunchTiming | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._node = node
        self._own_offer = own_offer
        self._targets = targets
        self._direct_link = direct_link
        self.timing = timing or PunchTiming()
        self._loop = asyncio.get_running_loop()

    # -- initiator -----------------------------------------------------------------------

    async def initiate(self, link: PeerLink) -> PunchReport:
        """Punch to ``link``'s peer over ``link`` (a relayed one)."""
        peer = link.peer_id
        framed: FramedStream | None = None
        timing = self.timing
        try:
            framed = await link.open_stream(StreamType.HOLE_PUNCH)
            candidates, mapping = self._own_offer()
            sent_at = self._loop.time()
            await framed.send_frame(punch_messages.offer(candidates, mapping))
            answer = await self._next(framed, ("offer", "declined"), timing.answer_timeout_s)
            if answer.WhichOneof("kind") == "declined":
                declined = answer.declined
                return PunchReport(
                    PunchOutcome.DECLINED,
                    f"{short_id(peer)} declined: {punch_messages.decline_reason_name(declined.reason)}"
                    + (f" ({declined.detail})" if declined.detail else ""),
                    decline_reason=declined.reason,
                    retry_after_s=declined.retry_after_ms / 1000,
                )
            rtt = self._loop.time() - sent_at
            targets = self._targets(peer, answer.offer.candidates)
            await framed.send_frame(punch_messages.sync())
            # The sync reaches the responder half a round trip from now: punch then, so that our
            # NAT expects the peer just as its dial leaves.
            await asyncio.sleep(rtt / 2)
            punching = self._loop.create_task(self._punch(targets))
            try:
                result = await self._next(
                    framed, ("result",), timing.connect_timeout_s + timing.answer_timeout_s
                )
            finally:
                punching.cancel()
            reached = result.result.reached
            direct = await self._wait_direct(peer, 1.0 if reached else 0.0)
            if direct is None:
                return PunchReport(
                    PunchOutcome.FAILED,
                    f"{short_id(peer)} reached none of {', '.join(targets) or 'no candidates'}",
                    rtt_s=rtt,
                )
            return PunchReport(PunchOutcome.DIRECT, f"direct to {short_id(peer)}", reached, rtt, link=direct)
        except (MeshRefusal, RemoteRefusal, StreamError, FramingError, TimeoutError, DialError) as exc:
            return PunchReport(
                PunchOutcome.ERROR, f"punch exchange with {short_id(peer)}: {exc or type(exc).__name__}"
            )
        finally:
            if framed is not None:
                framed.close()

    # -- responder -----------------------------------------------------------------------

    async def respond(
        self, stream: FramedStream, decide: Callable[[bytes, Sequence[str]], Decline | None]
    ) -> PunchReport:
        """Answer an offer on ``stream`` (the dispatcher serves it); ``decide(peer, targets)`` says
        whether to take part (``None``) or why not."""
        peer = stream.peer_id
        timing = self.timing
        offer = await self._next(stream, ("offer",), timing.answer_timeout_s)
        targets = self._targets(peer, offer.offer.candidates)
        decline = decide(peer, targets)
        if decline is not None:
            await stream.send_frame(
                punch_messages.declined(decline.reason, decline.detail, decline.retry_after_s)
            )
            return PunchReport(
                PunchOutcome.DECLINED,
                f"declined {short_id(peer)}: {decline.detail}",
                decline_reason=decline.reason,
                retry_after_s=decline.retry_after_s,
            )
        candidates, mapping = self._own_offer()
        await stream.send_frame(punch_messages.offer(candidates, mapping))
        await self._next(stream, ("sync",), timing.answer_timeout_s)
        punching = self._loop.create_task(self._punch(targets))
        try:
            link = await self._dial_first(peer, targets)
        finally:
            punching.cancel()
        reached = describe_sockaddr(link.remote_address) if link is not None else ""
        with contextlib.suppress(StreamError):
            await stream.send_frame(punch_messages.result(reached))
        if link is None:
            return PunchReport(
                PunchOutcome.FAILED, f"reached none of {', '.join(targets)} of {short_id(peer)}"
            )
        return PunchReport(PunchOutcome.DIRECT, f"direct to {short_id(peer)}", reached, link=link)

    # -- the datagrams and the dials ---------------------------------------------------

    async def _punch(self, targets: Sequence[str]) -> None:
        timing = self.timing
        for _ in range(timing.datagrams):
            for address in targets:
                self._endpoint.send_datagram(address, PUNCH_DATAGRAM)
            await asyncio.sleep(timing.datagram_interval_s)

    async def _dial_first(self, peer: bytes, targets: Sequence[str]) -> QuicLink | None:
        """Dial each target, ``dial_stagger_s`` apart; the first link up, or ``None``."""
        if not targets:
            return None
        timing = self.timing
        winner = FirstLinkWins(self._node)

        async def dial(address: str, delay: float) -> None:
            await asyncio.sleep(delay)
            if winner.chosen is None:
                with contextlib.suppress(DialError):
                    await self._endpoint.dial(address, peer, timeout=timing.connect_timeout_s, handler=winner)

        dials = [
            self._loop.create_task(dial(address, i * timing.dial_stagger_s))
            for i, address in enumerate(targets)
        ]
        everything: asyncio.Future[Any] = asyncio.gather(*dials)
        chosen: asyncio.Future[Any] = self._loop.create_task(winner.chosen_event.wait())
        try:
            await asyncio.wait(
                [everything, chosen],
                timeout=timing.connect_timeout_s + timing.dial_stagger_s * len(targets),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            chosen.cancel()
            for task in dials:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await everything
        return winner.chosen

    async def _wait_direct(self, peer: bytes, patience_s: float) -> PeerLink | None:
        """The direct link kept to ``peer``, waiting up to ``patience_s`` for the dial's handshake
        to finish on this side."""
        deadline = self._loop.time() + patience_s
        while True:
            link = self._direct_link(peer)
            if link is not None or self._loop.time() >= deadline:
                return link
            await asyncio.sleep(0.02)

    @staticmethod
    async def _next(stream: FramedStream, expect: tuple[str, ...], timeout: float) -> traversal.PunchMessage:
        body = await stream.recv_frame(timeout)
        if body is None:
            raise StreamError(f"the peer ended the punch stream before its {'/'.join(expect)}")
        return punch_messages.read(body, expect=expect)


__all__ = ["PUNCH_DATAGRAM", "Decline", "FirstLinkWins", "PunchOutcome", "PunchReport", "Puncher"]
