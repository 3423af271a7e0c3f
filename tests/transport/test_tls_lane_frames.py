"""Frames on a bulk lane connection (real TLS over loopback TCP) are read at their announced size:
the length first, checked against the cap, then the body in one read; a frame larger than the
lane's reader holds goes through the decoder, and the cap and a cut-off frame fail as anywhere."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from meshnode.identity import NodeIdentity
from meshnode.transport.framed import FramedStream
from meshnode.transport.tls_lane import READ_BUFFER_BYTES, LaneContexts, TlsStream, dial_lane
from meshnode.wire.errors import FrameTooLarge, TruncatedFrame
from meshnode.wire.framing import MAX_FRAME_BYTES, encode_frame

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def lane_to_raw_server() -> AsyncIterator[tuple[TlsStream, asyncio.StreamWriter]]:
    """A client's lane stream, and the accepting side's writer, which sends whatever a test wants."""
    server_identity, client_identity = NodeIdentity.generate(), NodeIdentity.generate()
    server_contexts = LaneContexts(server_identity)
    server_contexts.trust([client_identity.node_id])
    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)
        await done.wait()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_contexts.server)
    port = server.sockets[0].getsockname()[1]
    connection = await dial_lane(
        "127.0.0.1", port, LaneContexts(client_identity), server_identity.node_id, timeout=5
    )
    try:
        yield connection.stream(), await asyncio.wait_for(accepted.get(), 5)
    finally:
        done.set()
        connection.close()
        server.close()
        await server.wait_closed()


def counting_reads(stream: TlsStream) -> tuple[list[int], list[int]]:
    """The sizes asked of ``stream.readexactly`` and of ``stream.read``, recorded from now on."""
    exact: list[int] = []
    pieces: list[int] = []
    readexactly, read = stream.readexactly, stream.read

    async def recording_readexactly(nbytes: int) -> bytes:
        exact.append(nbytes)
        return await readexactly(nbytes)

    async def recording_read(max_bytes: int = 65536) -> bytes:
        pieces.append(max_bytes)
        return await read(max_bytes)

    stream.readexactly = recording_readexactly
    stream.read = recording_read
    return exact, pieces


async def test_each_frame_is_read_at_its_size_and_a_larger_one_through_the_decoder():
    small = [b"", b"x" * 5, os.urandom(256 * 1024 + 20), os.urandom(READ_BUFFER_BYTES)]
    large = os.urandom(READ_BUFFER_BYTES + 1)
    async with lane_to_raw_server() as (stream, server):
        exact, pieces = counting_reads(stream)
        framed = FramedStream(stream, expect_stream_type=False)
        server.write(b"".join(encode_frame(body) for body in [*small, large, b"end"]))
        server.close()
        for body in small:
            assert await framed.recv_frame(timeout=10) == body
        # Two reads a frame, the length and then the body, and no pieces.
        assert exact == [n for body in small for n in (4, len(body))] and pieces == []
        assert await framed.recv_frame(timeout=10) == large
        # Its length was read the same way; its body came in the decoder's pieces.
        assert exact[-1] == 4 and len(pieces) >= 2
        assert await framed.recv_frame(timeout=10) == b"end"
        assert await framed.recv_frame(timeout=10) is None


async def test_a_length_over_the_cap_is_refused_once_its_4_bytes_are_read():
    async with lane_to_raw_server() as (stream, server):
        exact, pieces = counting_reads(stream)
        framed = FramedStream(stream, expect_stream_type=False)
        server.write(struct.pack("<I", MAX_FRAME_BYTES + 1) + b"x" * 1024)
        with pytest.raises(FrameTooLarge):
            await framed.recv_frame(timeout=10)
        assert exact == [4] and pieces == []
        # The stream is out of step from then on: it stays failed.
        with pytest.raises(FrameTooLarge):
            await framed.recv_frame(timeout=10)


async def test_a_connection_that_ends_inside_a_frame_fails_typed():
    async with lane_to_raw_server() as (stream, server):
        framed = FramedStream(stream, expect_stream_type=False)
        server.write(struct.pack("<I", 1000) + b"y" * 10)
        server.close()
        with pytest.raises(TruncatedFrame) as info:
            await framed.recv_frame(timeout=10)
        assert (info.value.buffered, info.value.expected) == (10, 1000)


async def test_a_connection_that_ends_inside_a_length_fails_typed():
    async with lane_to_raw_server() as (stream, server):
        framed = FramedStream(stream, expect_stream_type=False)
        server.write(encode_frame(b"whole") + b"\x07\x00")
        server.close()
        assert await framed.recv_frame(timeout=10) == b"whole"
        with pytest.raises(TruncatedFrame) as info:
            await framed.recv_frame(timeout=10)
        assert (info.value.buffered, info.value.expected) == (2, 4)
