"""Bulk lane connections carry one exchange after another: reused only after a reply that ended
cleanly, closed after one that did not, and given up when idle, by the client and by the server."""

from __future__ import annotations

import asyncio

import pytest
from helpers.polling import eventually

from meshnode.artifacts.fetcher import TransferError, fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import FullModel
from meshnode.artifacts.protocol import UNKNOWN_MODEL, encode_fetch, encode_manifest_query
from meshnode.artifacts.store import ArtifactStore
from meshnode.gen.meshnode.v1 import artifacts_pb2 as pb
from meshnode.transport.framed import FramedStream
from meshnode.transport.lane_pool import LanePool
from meshnode.transport.tls_lane import LaneConnection, LaneContexts, Redial, dial_lane
from meshnode.wire.framing import StreamType, encode_stream_open

from .lane_nodes import free_on_tcp_too, lanes_of, quic_port, serve_on_lane
from .transfer_nodes import CUT_TENSOR, CuttingHolding, mesh_of, paced

pytestmark = pytest.mark.timeout(60)


async def exchange(
    connection: LaneConnection, request: bytes, redial: Redial | None = None
) -> list[pb.ArtifactReply]:
    """One ARTIFACT exchange on ``connection``, as on a QUIC stream (the type byte, the request
    frame, then reply frames up to the reply's last), released for the next one."""
    stream = connection.stream(redial=redial)
    framed = FramedStream(stream, expect_stream_type=False, stream_type=StreamType.ARTIFACT)
    await stream.write(encode_stream_open(StreamType.ARTIFACT, request))
    replies: list[pb.ArtifactReply] = []
    while not replies or replies[-1].WhichOneof("kind") == "chunk":
        body = await framed.recv_frame(timeout=5)
        assert body is not None, "the connection ended inside a reply"
        reply = pb.ArtifactReply()
        reply.ParseFromString(body)
        replies.append(reply)
    framed.release()
    assert stream.released
    return replies


async def test_one_connection_carries_a_manifest_a_refusal_and_a_tensor_one_after_another(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        held = FullModel(tiny_model)
        source = await serve_on_lane(holder, held)
        listener = source.lane.server.listener
        contexts = LaneContexts(joiner.identity)
        connection = await dial_lane("127.0.0.1", quic_port(holder), contexts, holder.node_id, timeout=5)
        try:
            root = bytes.fromhex(tiny_manifest.root)
            (manifest,) = await exchange(connection, encode_manifest_query(root))
            assert manifest.WhichOneof("kind") == "manifest"
            # A refusal is a whole reply: the connection goes on.
            (refusal,) = await exchange(connection, encode_fetch(bytes(32), 0))
            assert refusal.WhichOneof("kind") == "refusal" and refusal.refusal.code == UNKNOWN_MODEL
            index = 1
            *chunks, end = await exchange(connection, encode_fetch(root, index))
            size = tiny_manifest.tensors[index].nbytes
            assert b"".join(reply.chunk.data for reply in chunks) == held.read(index, 0, size)
            assert end.WhichOneof("kind") == "end" and end.end.sent == size
            assert connection.exchanges == 3 and connection.usable
            assert listener.served[joiner.node_id] == 1 and listener.exchanges[joiner.node_id] == 3
            assert listener.connections_of(joiner.node_id) == 1
        finally:
            connection.close()
            await source.lane.close()


async def test_a_connection_whose_reply_was_cut_by_the_source_is_closed_never_reused(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    index = next(i for i, t in enumerate(tiny_manifest.tensors) if t.name == CUT_TENSOR)
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        cutting = await serve_on_lane(
            holder, CuttingHolding(FullModel(tiny_model), index, 16 * 4096), **paced()
        )
        listener = cutting.lane.server.listener
        lanes = lanes_of(joiner)
        try:
            store = ArtifactStore(tmp_path / "store")
            with store.open(tiny_manifest, tiny_metadata) as partial, pytest.raises(TransferError):
                await fetch_tensors(lanes.open_link, partial, [CUT_TENSOR], [cutting.id])
            # The holdings query's connection carried the tensor whose upload failed: it is gone on
            # both sides, not kept for another request.
            assert lanes.pool.idle_count(cutting.id) == 0
            await eventually(lambda: listener.connections_of(joiner.node_id) == 0, what="server closed it")
            assert listener.served[joiner.node_id] == 1 and listener.exchanges[joiner.node_id] == 2
            with store.open(tiny_manifest, tiny_metadata) as partial:
                report = await fetch_tensors(lanes.open_link, partial, [CUT_TENSOR], [cutting.id])
                assert partial.verified == frozenset([CUT_TENSOR])
            assert report.failed_sources == {} and report.quarantined == {}
            # A new connection for the next fetch's two requests, kept after the clean end.
            assert listener.served[joiner.node_id] == 2 and listener.exchanges[joiner.node_id] == 4
            assert lanes.pool.idle_count(cutting.id) == 1
        finally:
            lanes.close()
            await cutting.lane.close()


async def test_a_connection_whose_reply_the_fetcher_abandoned_is_closed_never_reused(
    tmp_path, tiny_model, tiny_manifest, tiny_metadata
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        # Slow enough that the fetch is stopped in the middle of the reply.
        source = await serve_on_lane(holder, FullModel(tiny_model), **paced())
        listener = source.lane.server.listener
        lanes = lanes_of(joiner)
        try:
            with ArtifactStore(tmp_path / "store").open(tiny_manifest, tiny_metadata) as partial:
                fetch = asyncio.ensure_future(
                    fetch_tensors(lanes.open_link, partial, [CUT_TENSOR], [source.id])
                )
                await eventually(lambda: source.server.uploaded_bytes > 0, what="the upload began")
                fetch.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await fetch
            assert lanes.pool.idle_count(source.id) == 0
            await eventually(lambda: listener.connections_of(joiner.node_id) == 0, what="server closed it")
            assert source.server.uploaded_bytes < tiny_manifest.tensor(CUT_TENSOR).nbytes
            assert listener.served[joiner.node_id] == 1
        finally:
            lanes.close()
            await source.lane.close()


async def test_an_idle_connection_is_closed_by_the_client_after_its_idle_timeout(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        listener = source.lane.server.listener
        lanes = lanes_of(joiner)
        lanes.pool = LanePool(idle_timeout=0.2)
        try:
            await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
            assert lanes.pool.idle_count(source.id) == 1
            await eventually(lambda: lanes.pool.idle_count(source.id) == 0, what="client gave it up")
            # The server saw it end: it waits for no next exchange on it.
            await eventually(lambda: listener.connections_of(joiner.node_id) == 0, what="server closed it")
            assert listener.exchanges[joiner.node_id] == 2
        finally:
            lanes.close()
            await source.lane.close()


async def test_an_idle_connection_is_closed_by_the_server_and_the_client_then_dials_anew(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        listener = source.lane.server.listener
        listener.idle_timeout = 0.2
        lanes = lanes_of(joiner)
        try:
            await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
            assert lanes.pool.idle_count(source.id) == 1
            await eventually(lambda: listener.connections_of(joiner.node_id) == 0, what="server closed it")
            manifest, _ = await fetch_manifest(lanes.open_link, tiny_manifest.root, [source.id])
            assert manifest == tiny_manifest
            assert lanes.lanes[source.id].startswith("TLS/TCP")
            assert listener.served[joiner.node_id] == 2 and listener.exchanges[joiner.node_id] == 4
        finally:
            lanes.close()
            await source.lane.close()


async def test_a_request_on_a_connection_the_server_had_closed_goes_out_again_on_a_new_one(
    tmp_path, tiny_model, tiny_manifest
):
    async with mesh_of(tmp_path, 2, free_on_tcp_too) as (holder, joiner):
        source = await serve_on_lane(holder, FullModel(tiny_model))
        listener = source.lane.server.listener
        listener.idle_timeout = 0.2
        contexts = LaneContexts(joiner.identity)

        async def dial() -> LaneConnection:
            return await dial_lane("127.0.0.1", quic_port(holder), contexts, holder.node_id, timeout=5)

        stale = await dial()
        fresh: list[LaneConnection] = []

        async def redial() -> LaneConnection:
            fresh.append(await dial())
            return fresh[-1]

        try:
            query = encode_manifest_query(bytes.fromhex(tiny_manifest.root))
            await exchange(stale, query)
            # The server closes it while the client has not read that yet, as when it closes an
            # idle connection just as the client takes it from its pool: the request goes out,
            # and the connection ends before any byte of the reply.
            stale.writer.transport.pause_reading()
            await eventually(lambda: listener.connections_of(joiner.node_id) == 0, what="server closed it")
            stale.writer.transport.resume_reading()
            assert stale.usable
            (reply,) = await exchange(stale, query, redial)
            assert reply.WhichOneof("kind") == "manifest"
            assert len(fresh) == 1 and fresh[0].exchanges == 1
            assert listener.served[joiner.node_id] == 2 and listener.exchanges[joiner.node_id] == 2
        finally:
            for connection in (stale, *fresh):
                connection.close()
            await source.lane.close()
