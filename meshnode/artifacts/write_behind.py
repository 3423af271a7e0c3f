"""A tensor's chunks written and hashed in a worker thread while the event loop reads the next ones.

On a fast lane the fetcher is CPU-bound, and writing each chunk to its place in the file
(``pwrite``) and hashing it (SHA-256) are a large part of its work per byte. Both release the
GIL, so in a thread they run on another core beside the event loop. One thread serves a whole
fetch and takes the chunks in the order they were handed over, so each
:class:`~.store.TensorWriter` still gets its tensor's bytes in order and hashes exactly what it
writes. What waits for the thread is bounded per tensor (:data:`PENDING_BYTES`): past that the
fetch awaits the thread, which holds its source back through flow control as a slow disk would.

Nothing is verified here: the fetcher calls :meth:`TensorWrites.drain` (every byte written, or
the local failure raised) before it verifies a tensor, keeps what arrived of it, or lets it go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque

from meshnode.artifacts.store import StoreError, TensorWriter

# Bytes of one tensor handed to the thread and not written yet, at most (a few chunks).
PENDING_BYTES = 2 << 20
# A chunk this small, with nothing of its tensor ahead of it, is written on the caller's thread:
# hashing and writing it costs less than handing it over and hearing back (a norm's few KB).
INLINE_BYTES = 16 << 10


class WriteBehind:
    """The writing thread of one fetch; :meth:`close` once every tensor's writes were drained."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tensor-writes"
        )

    def writes(self, writer: TensorWriter, pending_bytes: int = PENDING_BYTES) -> TensorWrites:
        return TensorWrites(self._executor, writer, pending_bytes)

    def close(self) -> None:
        # Waits for the thread: nothing may write into the model's file once it is closed.
        self._executor.shutdown(wait=True)


class TensorWrites:
    """The chunks of one tensor on their way to its writer, in order."""

    def __init__(
        self, executor: concurrent.futures.Executor, writer: TensorWriter, pending_bytes: int
    ) -> None:
        self.writer = writer
        self._executor = executor
        self._pending_limit = pending_bytes
        self._pending: deque[tuple[concurrent.futures.Future[None], int]] = deque()
        self._pending_bytes = 0
        # Where the writer stands once every chunk handed over is written.
        self.given = writer.written
        # The first local failure (our disk): later chunks are not written, so the writer's
        # count stays that of the bytes really in place, in order.
        self.error: StoreError | None = None

    def write(self, data: bytes) -> None:
        """Hand ``data`` (the tensor's next bytes) to the thread, or write it now if it is small
        and nothing is waiting ahead of it."""
        self.given += len(data)
        if len(data) <= INLINE_BYTES and not self._pending:
            self._write(data)
            return
        self._pending.append((self._executor.submit(self._write, data), len(data)))
        self._pending_bytes += len(data)

    async def wait_below_limit(self) -> None:
        """Wait while more than the limit waits to be written; StoreError if a write failed."""
        self._forget_done()
        while self._pending_bytes > self._pending_limit:
            await _written(self._pending[0][0])
            self._forget_done()
        self._raise_error()

    async def drain(self) -> None:
        """Wait until every chunk handed over is written; StoreError if a write failed."""
        if self._pending:
            await _written(self._pending[-1][0])
        self._forget_done()
        self._raise_error()

    def settle(self) -> None:
        """Block until every chunk handed over is written or skipped (a fetch that is ending: its
        writer is read next). Raises nothing; :attr:`error` says whether a write failed."""
        concurrent.futures.wait([future for future, _ in self._pending])
        self._forget_done()

    def _forget_done(self) -> None:
        # Futures complete in the order they were submitted (one thread).
        pending = self._pending
        while pending and pending[0][0].done():
            _, nbytes = pending.popleft()
            self._pending_bytes -= nbytes

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self, data: bytes) -> None:
        # In the thread, or on the caller's when nothing is pending (never both at once).
        if self.error is not None:
            return
        try:
            self.writer.write(data)
        except OSError as error:
            self.error = StoreError(f"cannot write {self.writer.tensor.name!r}: {error}")
        except StoreError as error:
            self.error = error


async def _written(future: concurrent.futures.Future[None]) -> None:
    # Shielded: a cancelled wait must not cancel the write itself, or the chunks after it would
    # land where it belongs.
    await asyncio.shield(asyncio.wrap_future(future))


__all__ = ["INLINE_BYTES", "PENDING_BYTES", "TensorWrites", "WriteBehind"]
