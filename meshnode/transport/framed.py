"""Length-prefixed frames over any :class:`~meshnode.transport.stream.MeshStream`.

The byte-level rules (type byte, ``[4-byte LE length][body]``, the 8 MiB cap
enforced before allocating and before writing) live in
:mod:`meshnode.wire.framing`; this wrapper only moves bytes between a stream and
a :class:`~meshnode.wire.framing.FrameDecoder`, applying the stream's
:class:`~meshnode.transport.read_limits.ReadLimits` (the connection's budget for
incomplete frames, the stall timeout).

A stream that offers exact reads (:attr:`MeshStream.exact_read_bytes`, the bulk lane) and
carries no read limits has each frame read at its size instead: its 4 length bytes, the
length checked against the cap, then the body in one read, so a 256 KiB chunk costs two
calls and one copy rather than a decoder fed 64 KiB at a time. The size is only ever asked
for once it passed the cap and is no larger than what the stream's reader holds anyway; a
larger frame goes through the decoder as on any stream.
"""

from __future__ import annotations

import asyncio
from collections import deque

from meshnode.transport.read_limits import ReadLimits, ResetReason, count_reset, reason_for_scope
from meshnode.transport.stream import MeshStream
from meshnode.wire.errors import BufferLimitExceeded, FrameStalled, TruncatedFrame
from meshnode.wire.framing import (
    LENGTH_PREFIX_BYTES,
    MAX_FRAME_BYTES,
    FrameDecoder,
    StreamType,
    frame_header,
)

_NO_LIMITS = ReadLimits()

READ_CHUNK = 64 * 1024
# Below this a frame is written with its header in one call (one QUIC frame).
_COALESCE_BYTES = 64 * 1024


class FramedStream:
    def __init__(
        self,
        stream: MeshStream,
        *,
        expect_stream_type: bool,
        stream_type: StreamType | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.stream = stream
        limits = getattr(stream, "read_limits", None) or _NO_LIMITS
        self._decoder = FrameDecoder(
            expect_stream_type=expect_stream_type, max_frame_bytes=max_frame_bytes, budget=limits.budget
        )
        self._stall_timeout = limits.stall_timeout
        # Read limits need the decoder: its budget counts a frame's bytes as they arrive, and the
        # stall timer runs between its reads; a whole-frame read could do neither.
        self._exact_read_bytes = stream.exact_read_bytes if limits is _NO_LIMITS else 0
        self._frames: deque[bytes] = deque()
        self._eof = False
        self._pending = b""
        self._stream_type = stream_type
        self.max_frame_bytes = max_frame_bytes

    @property
    def peer_id(self) -> bytes:
        return self.stream.peer_id

    @property
    def stream_type(self) -> StreamType | None:
        return self._stream_type if self._stream_type is not None else self._decoder.stream_type

    @property
    def max_recv_frame_bytes(self) -> int:
        return self._decoder.max_frame_bytes

    @max_recv_frame_bytes.setter
    def max_recv_frame_bytes(self, limit: int) -> None:
        """Change the cap on frames read from now on (the relay's, once a client registered)."""
        self._decoder.max_frame_bytes = limit

    async def read_stream_type(self, timeout: float | None) -> StreamType:
        """The opener's type byte (accepting side). Raises ``TimeoutError`` or a framing error."""
        async with asyncio.timeout(timeout):
            while self._decoder.stream_type is None:
                data = self._pending or await self.stream.read(READ_CHUNK)
                if not data:
                    self._decoder.end_of_stream()  # raises: the stream ended before the type byte
                # Decode only the type byte now: frame errors belong to the handler,
                # after admission, not to stream-type dispatch.
                self._decoder.feed(data[:1])
                self._pending = data[1:]
        return self._decoder.stream_type

    async def recv_frame(self, timeout: float | None = None) -> bytes | None:
        """The next frame body; ``None`` at a clean end of stream.

        Raises ``TimeoutError``, :class:`~meshnode.wire.errors.FramingError` (oversized
        prefix, stream ended mid-frame, :class:`~meshnode.wire.errors.BufferLimitExceeded`,
        :class:`~meshnode.wire.errors.FrameStalled`) or a transport ``StreamError``.
        """
        if not self._frames:
            if timeout is None:  # the hot path: no timer to arm
                await self._fill_until_frame()
            else:
                async with asyncio.timeout(timeout):
                    await self._fill_until_frame()
        return self._frames.popleft() if self._frames else None

    async def send_frame(self, body: bytes) -> None:
        header = frame_header(len(body), self.max_frame_bytes)  # refuses oversize before any write
        if len(body) < _COALESCE_BYTES:
            await self.stream.write(header + body)
        else:
            await self.stream.write(header)
            await self.stream.write(body)

    def finish(self) -> None:
        self.stream.finish()

    def reset(self, error_code: int) -> None:
        self._decoder.abandon()
        self.stream.reset(error_code)

    def close(self) -> None:
        """Finish and stop reading (see :meth:`MeshStream.close`)."""
        self._decoder.abandon()
        self.stream.close()

    def release(self) -> None:
        """Done with a conversation that ended cleanly (see :meth:`MeshStream.release`). Bytes read
        past its last frame belong to no frame of it: the stream is closed then, never reused."""
        if self._frames or self._pending or self._eof or not self._decoder.at_frame_boundary:
            self.close()
            return
        self._decoder.abandon()
        self.stream.release()

    async def _fill_until_frame(self) -> None:
        while not self._frames and not self._eof:
            await self._fill()

    async def _fill(self) -> None:
        if self._exact_read_bytes and not self._pending and self._decoder.at_frame_boundary:
            await self._fill_exact()
            return
        data, self._pending = self._pending or await self._read(), b""
        if not data:
            self._decoder.end_of_stream()
            self._eof = True
            return
        try:
            self._frames.extend(self._decoder.feed(data))
        except BufferLimitExceeded as exc:
            count_reset(reason_for_scope(exc.scope))
            raise

    async def _fill_exact(self) -> None:
        decoder = self._decoder
        try:
            header = await self.stream.readexactly(LENGTH_PREFIX_BYTES)
        except asyncio.IncompleteReadError as exc:
            # The end of the stream: clean here, at a frame boundary, or inside a length prefix.
            decoder.feed(exc.partial)
            decoder.end_of_stream()
            self._eof = True
            return
        except Exception:
            decoder.abandon()
            raise
        length = int.from_bytes(header, "little")
        if length > self._exact_read_bytes or length > decoder.max_frame_bytes:
            # Over the cap (the decoder refuses it, 4 bytes read) or more than the stream's reader
            # holds: the decoder's way, its body charged as it arrives.
            self._frames.extend(decoder.feed(header))
            return
        try:
            body = await self.stream.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            truncated = TruncatedFrame(len(exc.partial), length)
            decoder.abandon(truncated)
            raise truncated from None
        except Exception:
            decoder.abandon()
            raise
        self._frames.append(body)

    async def _read(self) -> bytes:
        decoder = self._decoder
        try:
            if self._stall_timeout is None or decoder.at_frame_boundary:
                return await self.stream.read(READ_CHUNK)
            try:
                async with asyncio.timeout(self._stall_timeout):
                    return await self.stream.read(READ_CHUNK)
            except TimeoutError:
                stalled = FrameStalled(decoder.buffered_bytes, self._stall_timeout)
                decoder.abandon(stalled)
                count_reset(ResetReason.STALLED)
                raise stalled from None
        except Exception:
            # The stream is dead (reset, link closed): nobody reads the partial frame now.
            # A cancelled read is not an Exception: the caller may read on afterwards.
            decoder.abandon()
            raise


__all__ = ["READ_CHUNK", "FramedStream"]
