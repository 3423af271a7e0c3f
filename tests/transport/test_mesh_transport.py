"""The stream abstraction over the in-process loopback, framing, and the dispatcher."""

import asyncio
import hashlib

import pytest
from helpers.mesh_helpers import Recorder, reset_code_of

from meshnode.mesh.dispatcher import Dispatcher
from meshnode.transport.base import LinkClosed, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.transport.loopback import loopback_link_pair
from meshnode.wire.errors import FrameTooLarge
from meshnode.wire.framing import MAX_FRAME_BYTES, StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

A, B = b"\x01" * 32, b"\x02" * 32
WINDOW = 64 * 1024


@pytest.fixture
async def pair():
    rec_a, rec_b = Recorder(), Recorder()
    a, b = loopback_link_pair(A, B, rec_a, rec_b, stream_window=WINDOW, connection_window=2 * WINDOW)
    return a, b, rec_a, rec_b


async def settle(rounds: int = 50) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_frames_round_trip_with_the_stream_type(pair):
    a, b, rec_a, rec_b = pair
    assert rec_a.established == [a] and rec_b.established == [b] and a.peer_id == B and b.peer_id == A
    opened = await a.open_stream(StreamType.GOSSIP)
    await opened.send_frame(b"hello")
    await opened.send_frame(b"")
    opened.finish()
    accepted = FramedStream(await rec_b.next_stream(), expect_stream_type=True)
    assert accepted.peer_id == A
    assert await accepted.read_stream_type(1.0) is StreamType.GOSSIP
    assert await accepted.recv_frame(1.0) == b"hello"
    assert await accepted.recv_frame(1.0) == b""
    assert await accepted.recv_frame(1.0) is None
    await accepted.send_frame(b"reply")
    accepted.finish()
    assert await opened.recv_frame(1.0) == b"reply"
    assert rec_a.accepted == []  # a reply does not look like a new stream to the opener


async def test_writer_waits_while_the_peer_does_not_read(pair):
    a, _b, _ra, rec_b = pair
    stream = await a.open_raw_stream()
    payload = bytes(range(256)) * 4096  # 1 MiB, 16 windows
    writer = asyncio.create_task(stream.write(payload))
    await settle()
    remote = await rec_b.next_stream()
    assert not writer.done()
    assert remote.recv.size <= WINDOW  # bounded by the window, not by the payload
    received = bytearray()
    while len(received) < len(payload):
        received += await remote.read(10_000)
    await writer
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


async def test_connection_window_bounds_all_streams_together(pair):
    a, b, _ra, _rb = pair
    streams = [await a.open_raw_stream() for _ in range(4)]
    writers = [asyncio.create_task(s.write(b"x" * WINDOW)) for s in streams]
    await settle()
    assert b.unread <= 2 * WINDOW
    assert sum(not w.done() for w in writers) >= 2
    for s in streams:
        s.reset(1)
    await asyncio.gather(*writers, return_exceptions=True)
    assert all(w.done() for w in writers)


async def test_reset_reaches_both_directions_of_the_peer(pair):
    a, _b, _ra, rec_b = pair
    stream = await a.open_raw_stream()
    await stream.write(b"abc")
    remote = await rec_b.next_stream()
    remote.reset(0x123)
    with pytest.raises(StreamReset) as info:
        await stream.read()
    assert info.value.error_code == 0x123 and info.value.by_peer
    with pytest.raises(StreamReset):
        await stream.write(b"more")


async def test_link_close_ends_every_stream_and_tells_both_owners(pair):
    a, b, rec_a, rec_b = pair
    stream = await a.open_raw_stream()
    reader = asyncio.create_task(stream.read())
    await settle(5)
    b.close("bye")
    with pytest.raises(LinkClosed):
        await reader
    assert a.is_closed and b.is_closed
    assert [r for _, r in rec_a.closed] == ["bye"] and len(rec_b.closed) == 1
    with pytest.raises(LinkClosed):
        await a.open_raw_stream()


async def test_framed_send_refuses_oversize_before_writing(pair):
    a, _b, _ra, rec_b = pair
    opened = await a.open_stream(StreamType.GOSSIP)
    with pytest.raises(FrameTooLarge):
        await opened.send_frame(bytes(MAX_FRAME_BYTES + 1))
    opened.finish()
    accepted = FramedStream(await rec_b.next_stream(), expect_stream_type=True)
    await accepted.read_stream_type(1.0)
    assert await accepted.recv_frame(1.0) is None  # nothing but the type byte was written


# -- dispatcher ------------------------------------------------------------------------------------------


class DispatchPair:
    def __init__(self, *, admitted: bool, **dispatcher_options) -> None:
        self.admitted = admitted
        self.dispatcher = Dispatcher(is_admitted=lambda peer: self.admitted, **dispatcher_options)
        outer = self

        class Serve(Recorder):
            def stream_accepted(self, link, stream):
                outer.dispatcher.accept(stream)

        self.client, self.server = loopback_link_pair(A, B, Recorder(), Serve())


async def echo(stream: FramedStream) -> None:
    while (frame := await stream.recv_frame(1.0)) is not None:
        await stream.send_frame(frame)


async def test_dispatcher_serves_registered_types_after_admission():
    setup = DispatchPair(admitted=True)
    setup.dispatcher.register(StreamType.PROBE, echo)
    stream = await setup.client.open_stream(StreamType.PROBE)
    await stream.send_frame(b"ping")
    stream.finish()
    assert await stream.recv_frame(1.0) == b"ping"
    assert await stream.recv_frame(1.0) is None


async def test_dispatcher_quarantines_unadmitted_peers_but_keeps_the_link():
    setup = DispatchPair(admitted=False)
    setup.dispatcher.register(StreamType.PROBE, echo)
    setup.dispatcher.register(StreamType.GOSSIP, echo, before_admission=True)
    refused = await setup.client.open_stream(StreamType.PROBE)
    await refused.send_frame(b"ping")
    assert await reset_code_of(refused) == mesh.MESH_ERROR_NOT_ADMITTED
    allowed = await setup.client.open_stream(StreamType.GOSSIP)
    await allowed.send_frame(b"hello")
    assert await allowed.recv_frame(1.0) == b"hello"
    assert not setup.client.is_closed
    assert setup.dispatcher.refusals == {"MESH_ERROR_NOT_ADMITTED": 1}


async def test_dispatcher_refusal_codes():
    async def refuse(stream):
        raise MeshRefusal(mesh.MESH_ERROR_SELF_REPORT)

    async def crash(stream):
        raise RuntimeError("bug")

    async def wait_for_frame(stream):
        await stream.recv_frame(0.05)

    setup = DispatchPair(admitted=True, stream_type_timeout=0.05)
    setup.dispatcher.register(StreamType.PEER_DOWN, refuse)
    setup.dispatcher.register(StreamType.PEER_LEAVING, crash)
    setup.dispatcher.register(StreamType.PROBE, wait_for_frame)
    setup.dispatcher.register(StreamType.GOSSIP, echo, before_admission=True)

    async def code_for(first_bytes: bytes) -> int:
        stream = await setup.client.open_raw_stream()
        await stream.write(first_bytes)
        return await reset_code_of(FramedStream(stream, expect_stream_type=False))

    assert await code_for(bytes([0x7F])) == mesh.MESH_ERROR_UNKNOWN_STREAM_TYPE
    assert await code_for(bytes([StreamType.SUBPROTOCOL])) == mesh.MESH_ERROR_UNKNOWN_STREAM_TYPE
    assert await code_for(bytes([StreamType.PEER_DOWN])) == mesh.MESH_ERROR_SELF_REPORT
    assert await code_for(bytes([StreamType.PEER_LEAVING])) == mesh.MESH_ERROR_INTERNAL
    assert await code_for(bytes([StreamType.PROBE])) == mesh.MESH_ERROR_READ_TIMEOUT
    oversize = bytes([StreamType.GOSSIP]) + (MAX_FRAME_BYTES + 1).to_bytes(4, "little")
    assert await code_for(oversize) == mesh.MESH_ERROR_FRAME_TOO_LARGE
    truncated = bytes([StreamType.GOSSIP]) + (10).to_bytes(4, "little") + b"abc"
    stream = await setup.client.open_raw_stream()
    await stream.write(truncated)
    stream.finish()
    assert await reset_code_of(FramedStream(stream, expect_stream_type=False)) == mesh.MESH_ERROR_MALFORMED
    # A stream whose type byte never comes.
    silent = await setup.client.open_raw_stream()
    assert silent.remote is not None
    await setup.dispatcher.serve(silent.remote)
    assert (
        await reset_code_of(FramedStream(silent, expect_stream_type=False))
        == mesh.MESH_ERROR_STREAM_TYPE_TIMEOUT
    )


async def test_dispatcher_bounds_concurrent_streams():
    async def hold(stream):
        await stream.recv_frame(5.0)

    setup = DispatchPair(admitted=True, max_concurrent_streams=1)
    setup.dispatcher.register(StreamType.PROBE, hold)
    first = await setup.client.open_stream(StreamType.PROBE)
    await settle()
    second = await setup.client.open_stream(StreamType.PROBE)
    assert await reset_code_of(second) == mesh.MESH_ERROR_OVERLOADED
    first.reset(1)
    await setup.dispatcher.aclose()


def test_only_quarantine_safe_types_may_skip_admission():
    dispatcher = Dispatcher(is_admitted=lambda peer: False)
    with pytest.raises(ValueError, match="before admission"):
        dispatcher.register(StreamType.SHARD_SESSION, echo, before_admission=True)
    dispatcher.register(StreamType.SHARD_SESSION, echo)
    with pytest.raises(ValueError, match="already registered"):
        dispatcher.register(StreamType.SHARD_SESSION, echo)
