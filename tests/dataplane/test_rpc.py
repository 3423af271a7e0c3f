"""The unary shard calls from the caller's side: each failure is one typed error, and the stream is closed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from meshnode.dataplane.edges import rpc
from meshnode.dataplane.errors import SessionTransportError
from meshnode.transport.base import MeshStream, PeerLink, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.transport.loopback import loopback_link_pair
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.mesh_refusal import reset_code
from meshnode.wire.pb import mesh, shard

A, B = b"\x01" * 32, b"\x02" * 32

Serve = Callable[[FramedStream], Awaitable[None]]


class Worker:
    """The far end of a loopback link, answering each stream with ``serve``."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.served: list[asyncio.Task[None]] = []

    def link_established(self, link: PeerLink) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.served.append(asyncio.ensure_future(self._serve(stream)))

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass

    async def _serve(self, raw: MeshStream) -> None:
        stream = FramedStream(raw, expect_stream_type=True)
        await stream.read_stream_type(1.0)
        await stream.recv_frame(1.0)
        await self.serve(stream)


class Caller:
    def link_established(self, link: PeerLink) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        raise AssertionError("the worker opened a stream")

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass


def link_to(serve: Serve) -> tuple[PeerLink, Worker]:
    worker = Worker(serve)
    link, _ = loopback_link_pair(A, B, Caller(), worker)
    return link, worker


async def test_a_response_is_decoded_and_the_stream_closed_after_it() -> None:
    extra_refused: list[bool] = []

    async def serve(stream: FramedStream) -> None:
        await stream.send_frame(shard.HealthReport(active_sessions=3).SerializeToString())
        await asyncio.sleep(0.01)
        try:
            await stream.send_frame(b"more")
        except StreamReset:
            extra_refused.append(True)

    link, worker = link_to(serve)
    assert (await rpc.get_health(link, timeout=1.0)).active_sessions == 3
    await asyncio.gather(*worker.served)
    assert extra_refused == [True]  # the caller closed its stream: nothing more is buffered for it


async def test_a_refusal_inside_the_response_is_a_shard_protocol_error() -> None:
    async def serve(stream: FramedStream) -> None:
        error = shard.ShardError(code=shard.ERROR_CODE_EPOCH_STALE, detail="route epoch is stale")
        await stream.send_frame(shard.CancelResponse(error=error).SerializeToString())

    link, _ = link_to(serve)
    with pytest.raises(ShardProtocolError) as refused:
        await rpc.send_cancel(link, shard.CancelRequest(), timeout=1.0)
    assert refused.value.code == shard.ERROR_CODE_EPOCH_STALE


async def ended(stream: FramedStream) -> None:
    stream.finish()


async def garbage(stream: FramedStream) -> None:
    await stream.send_frame(b"\xff\xff\xff")


async def refused(stream: FramedStream) -> None:
    stream.reset(reset_code(mesh.MESH_ERROR_NOT_ADMITTED))


async def silent(stream: FramedStream) -> None:
    await asyncio.sleep(1.0)


@pytest.mark.parametrize(
    ("serve", "message"),
    [
        (ended, "SHARD_HEALTH: the stream ended without a response"),
        (garbage, "SHARD_HEALTH: the response is not a well-formed message"),
        (refused, "SHARD_HEALTH: the peer refused the stream (MESH_ERROR_NOT_ADMITTED)"),
        (silent, "SHARD_HEALTH: no answer in time"),
    ],
)
async def test_each_transport_failure_is_a_session_transport_error(serve: Serve, message: str) -> None:
    link, worker = link_to(serve)
    with pytest.raises(SessionTransportError) as failed:
        await rpc.get_health(link, timeout=0.2)
    assert str(failed.value) == message
    for task in worker.served:
        task.cancel()


async def test_a_closed_link_is_a_session_transport_error() -> None:
    link, _ = link_to(ended)
    link.close("worker gone")
    with pytest.raises(SessionTransportError, match="SHARD_CAPABILITY: worker gone"):
        await rpc.get_capability(link, timeout=1.0)
