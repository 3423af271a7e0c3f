"""Caps on incomplete frames and the stall timeout, over real QUIC into a dispatcher;
their counters in /metrics and their options on the node commands.

The server side is a QUIC endpoint serving a dispatcher whose handler reads
frames with no timeout of its own, so every reset seen here comes from the
read limits (``meshnode.transport.read_limits``), not from a handler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from helpers.mesh_helpers import Recorder, reset_code_of
from helpers.polling import eventually

from meshnode.app.cli import build_parser
from meshnode.app.node_commands import node_config
from meshnode.commandline.config import parse_args_with_config
from meshnode.identity import NodeIdentity
from meshnode.mesh.dispatcher import Dispatcher, DispatchingLinkHandler
from meshnode.metrics import MetricSources, collect, samples_by_name
from meshnode.transport import read_limits
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicConfig, QuicEndpoint
from meshnode.transport.read_limits import ReadLimits, process_budget, reset_counts
from meshnode.wire.buffer_budget import BufferBudget, BufferScope
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(60)

KiB = 1024


@dataclass
class Served:
    endpoint: QuicEndpoint
    frames: list[bytes]

    @property
    def address(self) -> str:
        host, port = self.endpoint.local_address
        return f"{host}:{port}"


@contextlib.asynccontextmanager
async def served(settings: QuicConfig, process_budget: BufferBudget | None = None) -> AsyncIterator[Served]:
    frames: list[bytes] = []

    async def read_frames(stream: FramedStream) -> None:
        while (frame := await stream.recv_frame()) is not None:  # no timeout of its own
            frames.append(frame)

    dispatcher = Dispatcher(is_admitted=lambda _peer: True)
    dispatcher.register(StreamType.GOSSIP, read_frames, before_admission=True)
    endpoint = await QuicEndpoint.listen(
        NodeIdentity.generate(), DispatchingLinkHandler(dispatcher), "127.0.0.1", 0, settings
    )
    if process_budget is not None:
        endpoint.process_budget = process_budget
    try:
        yield Served(endpoint, frames)
    finally:
        await dispatcher.aclose()
        endpoint.close()
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def peer(server: Served) -> AsyncIterator[PeerLink]:
    endpoint = await QuicEndpoint.listen(NodeIdentity.generate(), Recorder(), "127.0.0.1", 0)
    try:
        yield await endpoint.dial(server.address, server.endpoint.identity.node_id)
    finally:
        endpoint.close()
        await asyncio.sleep(0)


async def partial_frame(link: PeerLink, announced: int, sent: int) -> MeshStream:
    stream = await link.open_raw_stream()
    await stream.write(bytes([StreamType.GOSSIP]) + announced.to_bytes(4, "little") + b"p" * sent)
    return stream


def server_links_hold(server: Served) -> int:
    return sum(link.read_limits.budget.held for link in server.endpoint.links if link.read_limits.budget)


async def test_the_stream_that_passes_its_connections_cap_is_reset_and_the_others_complete() -> None:
    before = reset_counts()
    async with served(QuicConfig(frame_buffer_per_connection=256 * KiB)) as server, peer(server) as link:
        # Any two fit under the cap, all three do not: exactly one stream passes it; and
        # with it gone, the other two can each complete (120 + 100 KiB at most).
        streams = [await partial_frame(link, 120 * KiB, 100 * KiB) for _ in range(3)]
        waits = {
            asyncio.create_task(reset_code_of(FramedStream(s, expect_stream_type=False), 10)): s
            for s in streams
        }
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        assert [task.result() for task in done] == [mesh.MESH_ERROR_OVERLOADED]
        assert reset_counts()["connection_buffer"] == before["connection_buffer"] + 1
        for task in pending:
            task.cancel()
        survivors = [waits[task] for task in pending]
        for stream in survivors:
            await stream.write(b"q" * 20 * KiB)
            stream.finish()
        await eventually(lambda: len(server.frames) >= 2, 10)
        assert server.frames == [b"p" * 100 * KiB + b"q" * 20 * KiB] * 2
        assert server_links_hold(server) == 0
        assert not link.is_closed


async def test_the_stream_that_passes_the_process_cap_is_reset() -> None:
    before = reset_counts()
    process = BufferBudget(150 * KiB, scope=BufferScope.PROCESS)
    async with (
        served(QuicConfig(), process_budget=process) as server,
        peer(server) as first,
        peer(server) as second,
    ):
        holding = await partial_frame(first, 200 * KiB, 100 * KiB)
        await eventually(lambda: process.held >= 100 * KiB, 10)
        crossing = await partial_frame(second, 200 * KiB, 100 * KiB)
        assert (
            await reset_code_of(FramedStream(crossing, expect_stream_type=False))
            == mesh.MESH_ERROR_OVERLOADED
        )
        assert reset_counts()["process_buffer"] == before["process_buffer"] + 1
        assert process.held == 100 * KiB  # the first stream's, still being received
        holding.reset(1)
        await eventually(lambda: not process.held, 10)


async def test_a_stream_stalled_mid_frame_is_reset_and_one_idle_between_frames_is_not() -> None:
    before = reset_counts()
    stall = 0.2
    async with served(QuicConfig(frame_stall_timeout=stall)) as server, peer(server) as link:
        idle = await link.open_stream(StreamType.GOSSIP)
        await idle.send_frame(b"first")
        stalled = await partial_frame(link, 100, 10)
        assert (
            await reset_code_of(FramedStream(stalled, expect_stream_type=False))
            == mesh.MESH_ERROR_READ_TIMEOUT
        )
        assert reset_counts()["stalled"] == before["stalled"] + 1
        samples = samples_by_name(await collect(MetricSources(), now=0.0))
        resets = {labels["reason"]: value for labels, value in samples["meshnode_frame_resets_total"]}
        assert resets["stalled"] == before["stalled"] + 1
        # Waiting at a frame boundary, however long, is not a stall.
        await asyncio.sleep(3 * stall)
        await idle.send_frame(b"second")
        idle.finish()
        assert await idle.recv_frame(10) is None
        assert Counter(server.frames) == {b"first": 1, b"second": 1}
        assert server_links_hold(server) == 0


def test_node_commands_take_the_caps_from_options_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Process-wide settings: restored afterwards.
    monkeypatch.setattr(process_budget(), "limit", process_budget().limit)
    monkeypatch.setattr(read_limits, "_connection_defaults", read_limits._connection_defaults)
    args = parse_args_with_config(
        build_parser(),
        ["start", "--frame-buffer-per-connection", "16MiB", "--link-timeout", "6"],
        {"MESHNODE_FRAME_BUFFER_TOTAL": "96MiB", "MESHNODE_START_FRAME_STALL_TIMEOUT": "7.5"},
    )
    quic = node_config(args).quic
    assert (quic.frame_buffer_per_connection, quic.frame_stall_timeout) == (16 * 1024 * 1024, 7.5)
    assert quic.idle_timeout == 6.0  # the other QUIC options survive
    assert process_budget().limit == 96 * 1024 * 1024
    relayed = ReadLimits.for_connection()  # what a relayed link gets
    assert relayed.budget is not None
    assert (relayed.budget.limit, relayed.budget.parent, relayed.stall_timeout) == (
        16 * 1024 * 1024,
        process_budget(),
        7.5,
    )
