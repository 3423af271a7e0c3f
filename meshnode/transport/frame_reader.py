"""Mesh frames read from any asyncio reader with ``readexactly`` (an ``asyncio.StreamReader``).

The byte rules are :mod:`meshnode.wire.framing`'s, and the cap holds here too: the 4 length
bytes are read and checked before the body is asked for, so an oversized prefix costs 4 bytes.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from meshnode.wire.errors import FrameTooLarge, TruncatedFrame
from meshnode.wire.framing import LENGTH_PREFIX_BYTES, MAX_FRAME_BYTES, StreamType, parse_stream_type


class ExactReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


async def read_stream_type(reader: ExactReader) -> StreamType:
    try:
        first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        raise TruncatedFrame(0, 1) from None
    return parse_stream_type(first[0])


async def read_frame(reader: ExactReader, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """Read one frame; ``None`` on a clean end of stream at a frame boundary.

    Reads the 4 length bytes, refuses an oversized length, and only then asks the
    reader for the body, so an oversized prefix costs 4 bytes, not the body.
    """
    try:
        header = await reader.readexactly(LENGTH_PREFIX_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise TruncatedFrame(len(exc.partial), LENGTH_PREFIX_BYTES) from None
    length = int.from_bytes(header, "little")
    if length > max_frame_bytes:
        raise FrameTooLarge(length, max_frame_bytes)
    if length == 0:
        return b""
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame(len(exc.partial), length) from None


__all__ = ["ExactReader", "read_frame", "read_stream_type"]
