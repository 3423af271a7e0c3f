"""An in-process connected pair of links, with the QUIC links' backpressure.

Used by fast tests and by layers that want a mesh peer without sockets. A write
waits while the peer has more than ``stream_window`` bytes unread on that stream
or ``connection_window`` unread on the whole link — what QUIC flow control does
when the application stops reading.
"""

from __future__ import annotations

import asyncio
import itertools

from meshnode.transport.base import LinkClosed, LinkHandler, MeshStream, PeerLink, StreamError, StreamReset
from meshnode.transport.buffers import Progress, ReceiveBuffer, write_as_credit_allows

DEFAULT_STREAM_WINDOW = 1024 * 1024
DEFAULT_CONNECTION_WINDOW = 4 * 1024 * 1024


class LoopbackStream(MeshStream):
    def __init__(self, link: LoopbackLink, stream_id: int) -> None:
        self._link = link
        self._id = stream_id
        self.peer_id = link.peer_id
        self.recv = ReceiveBuffer()
        self.remote: LoopbackStream | None = None
        self._send_error: Exception | None = None
        self._finished = False
        self._announced = False

    @property
    def stream_id(self) -> int:
        return self._id

    async def read(self, max_bytes: int = 65536) -> bytes:
        data = await self.recv.read(max_bytes)
        if data:
            self._link.unread -= len(data)
            self._link.remote_link().progress.notify()
        return data

    async def write(self, data: bytes) -> None:
        await write_as_credit_allows(
            data,
            self._link.progress,
            check_writable=self._remote_or_raise,
            credit=self._send_credit,
            send=self._send_piece,
        )

    def _send_credit(self) -> int:
        # What QUIC flow control would allow: the peer's unread bytes under both windows.
        remote = self._remote_or_raise()
        window = self._link.stream_window
        if remote.recv.size >= window or self._link.remote_link().unread >= self._link.connection_window:
            return 0
        return window - remote.recv.size

    def _send_piece(self, piece: memoryview) -> None:
        self._deliver(bytes(piece))

    def finish(self) -> None:
        if self._finished or self._send_error is not None:
            return
        self._finished = True
        remote = self._remote_or_none()
        if remote is not None:
            self._announce()
            remote.recv.feed_eof()

    def close(self) -> None:
        self.finish()
        self._link.unread -= self.recv.fail(StreamError("stream closed"))
        remote = self._remote_or_none()
        if remote is not None and remote._send_error is None:
            remote._send_error = StreamReset(0)  # what STOP_SENDING does to the peer's writes
            self._link.remote_link().progress.notify()

    def reset(self, error_code: int) -> None:
        self._abort(StreamReset(error_code, by_peer=False))
        remote = self._remote_or_none()
        if remote is not None:
            self._announce()
            remote._abort(StreamReset(error_code))

    def _abort(self, error: Exception) -> None:
        if self._send_error is None:
            self._send_error = error
        self._link.unread -= self.recv.fail(error)
        self._link.progress.notify()

    def _deliver(self, data: bytes) -> None:
        assert self.remote is not None
        self._announce()
        self.remote.recv.feed(data)
        self._link.remote_link().unread += len(data)

    def _announce(self) -> None:
        # Like QUIC, the peer learns of a stream when the first byte (or FIN) arrives.
        if not self._announced:
            self._announced = True
            remote_link = self._link.remote_link()
            assert self.remote is not None
            remote_link.handler.stream_accepted(remote_link, self.remote)

    def _remote_or_none(self) -> LoopbackStream | None:
        return None if self._link.is_closed else self.remote

    def _remote_or_raise(self) -> LoopbackStream:
        if self._send_error is not None:
            raise self._send_error
        if self._finished:
            raise StreamError("write after finish")
        if self._link.is_closed or self.remote is None:
            raise LinkClosed(self._link.close_reason)
        return self.remote


class LoopbackLink(PeerLink):
    _ids = itertools.count()

    def __init__(
        self,
        *,
        peer_id: bytes,
        handler: LinkHandler,
        initiated_locally: bool,
        stream_window: int,
        connection_window: int,
    ) -> None:
        self.peer_id = peer_id
        self.handler = handler
        self.initiated_locally = initiated_locally
        self.established_at = asyncio.get_running_loop().time()
        self.stream_window = stream_window
        self.connection_window = connection_window
        self.progress = Progress()
        self.unread = 0
        self.remote: LoopbackLink | None = None
        self.close_reason = ""
        self._closed = asyncio.Event()
        self._streams: list[LoopbackStream] = []
        self._next_id = 0 if initiated_locally else 1

    def remote_link(self) -> LoopbackLink:
        assert self.remote is not None
        return self.remote

    async def open_raw_stream(self) -> MeshStream:
        if self.is_closed:
            raise LinkClosed(self.close_reason)
        local = LoopbackStream(self, self._next_id)
        remote = LoopbackStream(self.remote_link(), self._next_id)
        self._next_id += 2
        local.remote, remote.remote = remote, local
        # The opener announces the stream; replies on it must not announce it back to the opener.
        remote._announced = True
        self._streams.append(local)
        self.remote_link()._streams.append(remote)
        return local

    def close(self, reason: str = "") -> None:
        self._shutdown(reason or "closed")
        self.remote_link()._shutdown(reason or "closed by peer")

    def _shutdown(self, reason: str) -> None:
        if self.is_closed:
            return
        self.close_reason = reason
        self._closed.set()
        for stream in self._streams:
            stream._abort(LinkClosed(reason))
        self._streams.clear()
        self.progress.notify()
        self.handler.link_closed(self, reason)

    @property
    def description(self) -> str:
        return "loopback"


def loopback_link_pair(
    id_a: bytes,
    id_b: bytes,
    handler_a: LinkHandler,
    handler_b: LinkHandler,
    *,
    stream_window: int = DEFAULT_STREAM_WINDOW,
    connection_window: int = DEFAULT_CONNECTION_WINDOW,
) -> tuple[LoopbackLink, LoopbackLink]:
    """Two connected links: ``a`` (dialed by A, peer B) and ``b`` (accepted by B, peer A).

    Both handlers get ``link_established`` before this returns.
    """
    a = LoopbackLink(
        peer_id=id_b,
        handler=handler_a,
        initiated_locally=True,
        stream_window=stream_window,
        connection_window=connection_window,
    )
    b = LoopbackLink(
        peer_id=id_a,
        handler=handler_b,
        initiated_locally=False,
        stream_window=stream_window,
        connection_window=connection_window,
    )
    a.remote, b.remote = b, a
    handler_a.link_established(a)
    handler_b.link_established(b)
    return a, b


__all__ = ["LoopbackLink", "LoopbackStream", "loopback_link_pair"]
