"""A head's answer stream to its route's tail: the tail's tokens straight back (asyncio edge).

:class:`AnswerStream` opens the stream over the tail's own link (a relayed tail through the
relay, with the same frames), hands every frame to the session's
:class:`~meshnode.dataplane.client.SessionClient` (``receive_answer_frame``) and tells its
session to settle after each read. It owns the stream, its task, and the answer streams still
read to their end behind a move; the session owns everything else. Until the tail has the
stream, and after it is lost, the tail answers along the route, so a session never depends on
it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from meshnode.dataplane.client import SessionClient
from meshnode.dataplane.edges.stream_io import LinkSource, reset_quietly, write_frames
from meshnode.transport.base import PeerLink
from meshnode.transport.framed import READ_CHUNK, FramedStream
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.framing import FrameDecoder, StreamType
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectAnswers:
    """Where a head's session gets its tail's tokens directly: a link to the tail (or a factory of
    links), and the tail's range (its answer stream is opened as for the tail's own session)."""

    links: LinkSource
    tail_range: shard.ShardRange


class AnswerStream:
    def __init__(
        self,
        client: SessionClient,
        answers: DirectAnswers,
        settle: Callable[[], None],
        *,
        max_reconnects: int,
        reconnect_backoff_s: float,
    ) -> None:
        self._client = client
        self._answers = answers
        # The session's own step after anything touched the client.
        self._settle = settle
        self._max_reconnects = max_reconnects
        self._backoff_s = reconnect_backoff_s
        self._loop = asyncio.get_running_loop()
        self._stopped = False
        # Accepted by the tail (True), lost or refused (False), or opening.
        self.ready: asyncio.Future[bool] = self._loop.create_future()
        self._stream: FramedStream | None = None
        # Answer streams whose link was superseded, read to their end behind the move.
        self._moving: set[asyncio.Task[str]] = set()
        self.task = self._loop.create_task(self._serve())

    def stop(self) -> None:
        """The session is over: stop reading, reset the stream, settle ``ready`` as False."""
        self._stopped = True
        for task in (self.task, *self._moving):
            task.cancel()
        stream, self._stream = self._stream, None
        reset_quietly(stream)
        if not self.ready.done():
            self.ready.set_result(False)

    async def _serve(self) -> None:
        """Open the answer stream to the tail and hand its direct answers to the client until it
        ends. A stream that fails before the tail accepted it is tried again (up to
        ``max_reconnects`` times, backing off: the tail may not yet admit this node); one that
        was accepted and then lost is not re-opened: the tail answers along the route again.
        One whose link is superseded (a direct link replaced the relayed one, which closes
        shortly) moves: a new answer stream opens on the link kept now while the old one is read
        to its end, and the tail answers on the newest, so no answer is lost in the move."""
        reason = "the tail ended the answer stream"
        attempt = 0
        while attempt <= self._max_reconnects:
            if attempt:
                await asyncio.sleep(self._backoff_s * attempt)
            reason, moved = await self._one_stream()
            if self._stopped:
                break
            if moved:
                attempt = 0
                continue
            if self.ready.done():
                break
            attempt += 1
        if not self.ready.done():
            self.ready.set_result(False)
        if not self._stopped:
            log.debug("session %s: no direct answers any more: %s", self._client.route_session_id, reason)
            self._client.answers_lost()
            self._settle()

    async def _one_stream(self) -> tuple[str, bool]:
        """Serve one answer stream until it ends, or until its link is superseded (then it is read
        to its end in the background); returns why it ended, and whether it moved."""
        framed: FramedStream | None = None
        try:
            source = self._answers.links
            link = source if isinstance(source, PeerLink) else await source()
            framed = await link.open_stream(StreamType.SHARD_SESSION)
            self._stream = framed
            await write_frames(framed, self._client.answer_stream_start(self._answers.tail_range))
            reader = self._loop.create_task(self._read_answers(framed))
            superseded = self._loop.create_task(link.wait_superseded())
            try:
                await asyncio.wait((reader, superseded), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                reader.cancel()
                raise
            finally:
                superseded.cancel()
            if not reader.done():
                self._moving.add(reader)
                reader.add_done_callback(self._moved_read)
                return f"{link.description} was superseded", True
            return await reader, False
        except asyncio.CancelledError:
            raise
        except ShardProtocolError as exc:
            # The tail refused (or broke the protocol): asking again would get the same answer.
            reset_quietly(framed)
            if not self.ready.done():
                self.ready.set_result(False)
            return str(exc), False
        except Exception as exc:
            reset_quietly(framed)
            return str(exc) or type(exc).__name__, False
        finally:
            if self._stream is framed:
                self._stream = None

    async def _read_answers(self, framed: FramedStream) -> str:
        stream = framed.stream
        limits = getattr(stream, "read_limits", None)
        # The tail is a member, not trusted: its answers charge the link's budget too.
        decoder = FrameDecoder(expect_stream_type=False, budget=limits.budget if limits else None)
        try:
            while data := await stream.read(READ_CHUNK):
                for body in decoder.feed(data):
                    self._client.receive_answer_frame(body)
                    if not self.ready.done():
                        self.ready.set_result(True)
                self._settle()
            decoder.end_of_stream()
        except BaseException:
            reset_quietly(framed)
            raise
        return "the tail ended the answer stream"

    def _moved_read(self, reader: asyncio.Task[str]) -> None:
        """An answer stream that moved to a new link ended: what it carried was read; how it
        ended no longer matters (its link closes behind the move)."""
        self._moving.discard(reader)
        if not reader.cancelled():
            reader.exception()


__all__ = ["AnswerStream", "DirectAnswers"]
