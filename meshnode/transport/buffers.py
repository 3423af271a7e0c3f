"""Bounded-buffer primitives shared by the stream implementations."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Progress:
    """Wakes every task waiting for "something changed" (acks arrived, a reader read)."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def notify(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._waiter)


class ReceiveBuffer:
    """Bytes the transport delivered that the application has not read yet.

    The transport bounds how much may arrive (flow-control credit); this class
    only keeps order, end of stream and the error that ended the stream.
    """

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._size

    @property
    def error(self) -> Exception | None:
        return self._error

    def feed(self, data: bytes) -> None:
        if self._eof or self._error is not None or not data:
            return
        self._chunks.append(data)
        self._size += len(data)
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, error: Exception) -> int:
        """End the stream with ``error``; returns the unread bytes dropped."""
        if self._error is None:
            self._error = error
        dropped = self._size
        self._chunks.clear()
        self._size = 0
        self._wake()
        return dropped

    async def read(self, max_bytes: int) -> bytes:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        head = self._chunks[0]
        if len(head) <= max_bytes:
            self._chunks.popleft()
        else:
            self._chunks[0] = head[max_bytes:]
            head = head[:max_bytes]
        self._size -= len(head)
        return head

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def write_as_credit_allows(
    data: bytes | memoryview,
    progress: Progress,
    *,
    check_writable: Callable[[], object],
    credit: Callable[[], int],
    send: Callable[[memoryview], None],
) -> None:
    """Send ``data`` in pieces no larger than the credit the peer has left, waiting on ``progress``
    while there is none: the one write loop of every stream (QUIC, relay channel, loopback).

    ``check_writable`` raises when the stream can no longer send (reset, finished, link
    closed); it runs before every piece (an empty write checks once), so a stream that dies
    while a writer waits fails that writer. ``credit()`` is how many bytes may go now (0:
    wait); ``send(piece)`` takes the whole piece it is given, or raises.
    """
    view = memoryview(data)
    while True:
        check_writable()
        if not view:
            return
        allowed = credit()
        if allowed <= 0:
            await progress.wait()
            continue
        piece, view = view[:allowed], view[allowed:]
        send(piece)
        # Not checked again after the last piece: a loopback peer that resets the stream as
        # the bytes land (synchronously) must not fail a write that QUIC would have completed.
        if not view:
            return


__all__ = ["Progress", "ReceiveBuffer", "write_as_credit_allows"]
