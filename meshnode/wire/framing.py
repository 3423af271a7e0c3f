"""mesh-llm/1 stream framing, sans-IO.

A stream opener writes one stream-type byte, then frames
``[4-byte little-endian length][body]``. Replies on the same stream are frames
without a type byte. Frames are capped at :data:`MAX_FRAME_BYTES`: a decoder
refuses an oversized length as soon as it has the 4 length bytes, before it
buffers any of the body, and an encoder refuses before producing any byte.

An announced length is only a claim: the decoder's buffer grows with the bytes
that arrive, never from the length (CPython zero-fills ``bytearray(n)``, so
reserving the announced size would make every page resident at once), and the
bytes it holds can be charged to a :class:`~meshnode.wire.buffer_budget.BufferBudget`.

The decoder takes byte chunks split anywhere (QUIC delivers whatever it has)
and yields whole frames. Nothing here does I/O: the asyncio readers of the same
frames are :mod:`meshnode.transport.framed` (over a mesh stream) and
:mod:`meshnode.transport.frame_reader` (over anything with ``readexactly``).
"""

from __future__ import annotations

import struct
import weakref
from enum import IntEnum

from meshnode.wire.buffer_budget import BufferBudget, BufferHold
from meshnode.wire.errors import FrameTooLarge, FramingError, TruncatedFrame, UnknownStreamType

MAX_FRAME_BYTES = 8 * 1024 * 1024
LENGTH_PREFIX_BYTES = 4
NODE_PROTOCOL_GENERATION = 1
ALPN = "mesh-llm/1"

_LENGTH = struct.Struct("<I")


class StreamType(IntEnum):
    """First byte of every stream (or relay channel)."""

    GOSSIP = 0x01
    # Delta gossip between admitted members: a digest, then what differs (mesh.proto DigestOpen).
    GOSSIP_DIGEST = 0x02
    ROUTE_REQUEST = 0x05
    PEER_DOWN = 0x06
    PEER_LEAVING = 0x07
    SUBPROTOCOL = 0x0D
    # Liveness probe used to confirm a PeerDown report before acting on it.
    PROBE = 0x0E
    # Hole punching between members behind NAT, on their relayed link (traversal.proto).
    HOLE_PUNCH = 0x0F
    # Shard data plane: one long-lived session stream per route session seam.
    SHARD_SESSION = 0x20
    # Unary shard calls, one request and one response on a fresh stream each.
    SHARD_CAPABILITY = 0x21
    SHARD_HEALTH = 0x22
    SHARD_RELEASE = 0x23
    SHARD_CANCEL = 0x24
    # Model artifacts (manifest, metadata, tensor bytes): meshnode/artifacts.
    ARTIFACT = 0x30


def parse_stream_type(value: int) -> StreamType:
    try:
        return StreamType(value)
    except ValueError:
        raise UnknownStreamType(value) from None


def frame_header(length: int, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Length prefix for a body of ``length`` bytes; refuses oversize first."""
    if length > max_frame_bytes:
        raise FrameTooLarge(length, max_frame_bytes)
    return _LENGTH.pack(length)


def encode_frame(body: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    return frame_header(len(body), max_frame_bytes) + body


def encode_stream_open(
    stream_type: StreamType, body: bytes | None = None, max_frame_bytes: int = MAX_FRAME_BYTES
) -> bytes:
    """The type byte, followed by the first frame when ``body`` is given."""
    prefix = bytes((int(stream_type),))
    if body is None:
        return prefix
    return prefix + encode_frame(body, max_frame_bytes)


class FrameDecoder:
    """Incremental decoder for one direction of one stream.

    ``expect_stream_type`` is true on the accepting side of a stream, whose first
    byte names the stream type. After any error the decoder stays failed: the
    stream is no longer in sync and must be closed.

    With a ``budget``, every body byte held for an incomplete frame is charged to
    it before it is kept, and given back when the frame completes, the decoder
    fails, :meth:`abandon` is called or the decoder is garbage. A charge the
    budget refuses fails the decoder with
    :class:`~meshnode.wire.errors.BufferLimitExceeded`.
    """

    _TYPE, _HEADER, _BODY, _FAILED = range(4)

    def __init__(
        self,
        *,
        expect_stream_type: bool,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        budget: BufferBudget | None = None,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.stream_type: StreamType | None = None
        self._state = self._TYPE if expect_stream_type else self._HEADER
        self._header = bytearray()
        self._body = bytearray()
        self._body_length = 0
        self._error: FramingError | None = None
        self._hold = BufferHold(budget) if budget is not None else None
        self._finalizer: weakref.finalize[..., FrameDecoder] | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for an incomplete frame: what arrived, never more than one frame's worth."""
        return len(self._header) + len(self._body)

    @property
    def at_frame_boundary(self) -> bool:
        return self._state == self._HEADER and not self._header

    def abandon(self, error: FramingError | None = None) -> None:
        """Nobody will read this stream further: drop the partial frame and its budget charge."""
        if self._error is None:
            self._fail(error or FramingError("stream abandoned"))

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(memoryview(data).cast("B"))
        except FramingError as exc:
            self._fail(exc)
            raise

    def end_of_stream(self) -> None:
        """The peer finished sending; refuse if that was mid-frame."""
        if self._error is not None:
            raise self._error
        if self._state == self._TYPE:
            self._fail(TruncatedFrame(0, 1))
        elif self._state == self._BODY:
            self._fail(TruncatedFrame(len(self._body), self._body_length))
        elif self._header:
            self._fail(TruncatedFrame(len(self._header), LENGTH_PREFIX_BYTES))
        if self._error is not None:
            raise self._error

    def _fail(self, exc: FramingError) -> None:
        self._error = exc
        self._state = self._FAILED
        self._header.clear()
        self._drop_body()

    def _drop_body(self) -> None:
        # A fresh object, not clear(): a clear() would keep the grown allocation.
        self._body = bytearray()
        self._body_length = 0
        if self._hold is not None:
            self._hold.release()

    def _hold_more(self, nbytes: int) -> None:
        assert self._hold is not None
        if self._finalizer is None:
            # Streams are dropped on many paths (resets, timeouts, cancelled handlers);
            # whichever way a decoder goes away, its charge goes with it.
            self._finalizer = weakref.finalize(self, self._hold.release)
            self._finalizer.atexit = False
        self._hold.reserve(nbytes)

    def _feed(self, view: memoryview) -> list[bytes]:
        frames: list[bytes] = []
        pos, end = 0, len(view)
        while pos < end:
            if self._state == self._TYPE:
                self.stream_type = parse_stream_type(view[pos])
                pos += 1
                self._state = self._HEADER
            elif self._state == self._HEADER:
                take = min(LENGTH_PREFIX_BYTES - len(self._header), end - pos)
                self._header += view[pos : pos + take]
                pos += take
                if len(self._header) < LENGTH_PREFIX_BYTES:
                    break
                (length,) = _LENGTH.unpack(self._header)
                self._header.clear()
                if length > self.max_frame_bytes:
                    raise FrameTooLarge(length, self.max_frame_bytes)
                if end - pos >= length:
                    # Whole body already here: one copy, no intermediate buffer.
                    frames.append(bytes(view[pos : pos + length]))
                    pos += length
                else:
                    # Nothing is allocated for the announced length: the body
                    # grows as its bytes arrive (see the module docstring).
                    self._body_length = length
                    self._state = self._BODY
            else:
                take = min(self._body_length - len(self._body), end - pos)
                if self._hold is not None:
                    self._hold_more(take)
                self._body += view[pos : pos + take]
                pos += take
                if len(self._body) == self._body_length:
                    frames.append(bytes(self._body))
                    self._drop_body()
                    self._state = self._HEADER
        return frames


__all__ = [
    "ALPN",
    "LENGTH_PREFIX_BYTES",
    "MAX_FRAME_BYTES",
    "NODE_PROTOCOL_GENERATION",
    "FrameDecoder",
    "FramingError",
    "StreamType",
    "encode_frame",
    "encode_stream_open",
    "frame_header",
    "parse_stream_type",
]
