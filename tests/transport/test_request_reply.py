"""request_reply: one frame out, one back, the stream always closed, and its failures mapped once."""

import asyncio

import pytest
from helpers.mesh_helpers import Recorder

from meshnode.transport.base import LinkClosed, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.transport.loopback import loopback_link_pair
from meshnode.transport.request_reply import request_reply
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import RemoteRefusal, reset_code
from meshnode.wire.pb import mesh

A, B = b"\x01" * 32, b"\x02" * 32


@pytest.fixture
async def pair():
    rec_a, rec_b = Recorder(), Recorder()
    a, _b = loopback_link_pair(A, B, rec_a, rec_b)
    return a, rec_b


async def accepted_request(recorder: Recorder) -> tuple[FramedStream, bytes | None]:
    """The server side: the stream the client opened, and the one frame it sent."""
    stream = FramedStream(await recorder.next_stream(), expect_stream_type=True)
    assert await stream.read_stream_type(1.0) is StreamType.PROBE
    return stream, await stream.recv_frame(1.0)


async def test_the_reply_comes_back_and_the_stream_is_closed_after_it(pair):
    link, server = pair

    async def serve() -> None:
        stream, body = await accepted_request(server)
        assert body == b"ping" and await stream.recv_frame(1.0) is None  # the client finished
        await stream.send_frame(b"pong")
        # Closed by the client once it had its reply: a second frame is refused, not buffered.
        await asyncio.sleep(0.01)
        with pytest.raises(StreamReset):
            await stream.send_frame(b"more")

    served = asyncio.create_task(serve())
    assert await request_reply(link, StreamType.PROBE, b"ping", timeout=1.0) == b"pong"
    await served


async def test_a_stream_ended_without_a_reply_is_none(pair):
    link, server = pair

    async def serve() -> None:
        stream, _ = await accepted_request(server)
        stream.finish()

    served = asyncio.create_task(serve())
    assert await request_reply(link, StreamType.PROBE, b"bye", timeout=1.0) is None
    await served


async def test_a_reset_with_a_mesh_code_is_the_peers_refusal(pair):
    link, server = pair

    async def serve() -> None:
        stream, _ = await accepted_request(server)
        stream.reset(reset_code(mesh.MESH_ERROR_NOT_ADMITTED))

    served = asyncio.create_task(serve())
    with pytest.raises(RemoteRefusal) as refused:
        await request_reply(link, StreamType.PROBE, b"hello", timeout=1.0)
    assert refused.value.code == mesh.MESH_ERROR_NOT_ADMITTED
    await served


async def test_a_reset_with_another_code_stays_a_stream_reset(pair):
    link, server = pair

    async def serve() -> None:
        stream, _ = await accepted_request(server)
        stream.reset(0x1)

    served = asyncio.create_task(serve())
    with pytest.raises(StreamReset) as reset:
        await request_reply(link, StreamType.PROBE, b"hello", timeout=1.0)
    assert reset.value.error_code == 0x1 and not isinstance(reset.value, RemoteRefusal)
    await served


async def test_no_reply_in_time_is_a_timeout_and_the_stream_is_closed(pair):
    link, server = pair
    with pytest.raises(TimeoutError):
        await request_reply(link, StreamType.PROBE, b"anyone?", timeout=0.05)
    stream, _ = await accepted_request(server)
    with pytest.raises(StreamReset):  # the client gave up on the stream, so the late reply is refused
        await stream.send_frame(b"too late")


async def test_a_closed_link_is_link_closed(pair):
    link, _server = pair
    link.close("gone")
    with pytest.raises(LinkClosed):
        await request_reply(link, StreamType.PROBE, b"hello", timeout=1.0)
