"""Frames read from an asyncio reader: the cap is checked before the body is asked for."""

import asyncio
import struct

import pytest

from meshnode.transport.frame_reader import read_frame, read_stream_type
from meshnode.wire.errors import FrameTooLarge, TruncatedFrame
from meshnode.wire.framing import StreamType, encode_frame


class RecordingReader:
    """A reader that records every read size, to prove what was read/allocated."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = 0
        self.requests: list[int] = []

    async def readexactly(self, n: int) -> bytes:
        self.requests.append(n)
        chunk = self.data[self.position : self.position + n]
        self.position += len(chunk)
        if len(chunk) < n:
            raise asyncio.IncompleteReadError(chunk, n)
        return chunk


async def test_oversized_prefix_on_a_reader_reads_only_the_header():
    reader = RecordingReader(bytes([StreamType.ROUTE_REQUEST]) + struct.pack("<I", 0xFFFFFFFF) + b"x" * 64)
    assert await read_stream_type(reader) is StreamType.ROUTE_REQUEST
    with pytest.raises(FrameTooLarge):
        await read_frame(reader)
    assert reader.requests == [1, 4]
    assert reader.position == 5


async def test_reader_round_trip_and_clean_end():
    reader = RecordingReader(encode_frame(b"hello") + encode_frame(b""))
    assert await read_frame(reader) == b"hello"
    assert await read_frame(reader) == b""
    assert await read_frame(reader) is None


async def test_reader_truncated_body_is_typed():
    reader = RecordingReader(encode_frame(b"hello")[:-2])
    with pytest.raises(TruncatedFrame) as info:
        await read_frame(reader)
    assert (info.value.buffered, info.value.expected) == (3, 5)
