"""The asyncio edge (ShardServer, ShardSession, unary calls) over in-process loopback links.

Real dispatchers, real streams with backpressure, real engine threads; the engine
is the deterministic fake (with its fault and delay hooks), so every test is fast.
The same edge over real QUIC and the llama.cpp engine is in test_two_process.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
from helpers.loopback_mesh import LoopbackMesh, MeshPeer
from helpers.polling import eventually
from helpers.recording_engine import LAYERS, RecordingEngine

from engines.interface import METRIC_STEPS_CANCELLED
from meshnode.dataplane.client import ClientConfig
from meshnode.dataplane.edges import rpc
from meshnode.dataplane.edges.server import ShardServer
from meshnode.dataplane.edges.shard_session import SessionConfig, ShardSession, default_client_config
from meshnode.dataplane.errors import SessionTransportError
from meshnode.dataplane.route import make_hop
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import reset_code
from meshnode.wire.pb import mesh, shard

from .harness import FP, reference, srange

pytestmark = pytest.mark.timeout(30)

SECOND = 1_000_000_000
PROMPT = [5, 3, 8, 1, 9, 2, 7]


@dataclass
class Edge:
    mesh: LoopbackMesh
    client: MeshPeer
    head: MeshPeer
    tail: MeshPeer
    head_engine: RecordingEngine
    tail_engine: RecordingEngine
    head_server: ShardServer
    tail_server: ShardServer

    def open(self, **kwargs: object) -> object:
        """A session to the head whose route continues to the tail (fresh links on reconnect)."""
        kwargs.setdefault("fingerprint", FP)
        kwargs.setdefault("shard_range", srange(0, 2))
        kwargs.setdefault("downstream", [make_hop(self.tail.node_id, 2, LAYERS, 2)])
        return ShardSession.open(lambda: self.client.get_link(self.head.node_id), **kwargs)


@pytest.fixture
async def edge() -> AsyncIterator[Edge]:
    loopback = LoopbackMesh()
    client, head, tail = loopback.add(1), loopback.add(2), loopback.add(3)
    head_engine, tail_engine = RecordingEngine(0, 2), RecordingEngine(2, LAYERS)
    head_server = ShardServer(head_engine, links=head.get_link)
    tail_server = ShardServer(tail_engine, links=tail.get_link)
    for server, peer in ((head_server, head), (tail_server, tail)):
        validation = await server.start()
        assert validation.validated
        server.register(peer.register_handler)
    for engine in (head_engine, tail_engine):  # forget the validation probe
        engine.calls.clear()
        engine.released.clear()
    yield Edge(loopback, client, head, tail, head_engine, tail_engine, head_server, tail_server)
    await head_server.aclose()
    await tail_server.aclose()
    await loopback.aclose()


async def generate(session: ShardSession, prompt: list[int], steps: int) -> list[int]:
    first = (await session.prefill(prompt)).token
    assert first is not None
    tokens = [first]
    for position in range(len(prompt), len(prompt) + steps):
        token = (await session.decode(tokens[-1], position=position)).token
        assert token is not None
        tokens.append(token)
    return tokens


async def test_a_chain_through_two_servers_generates_the_whole_models_tokens(edge: Edge) -> None:
    flow = shard.FlowControl(max_prefill_chunk_tokens=3)
    async with edge.open(config=ClientConfig(proposed_flow_control=flow)) as session:
        assert await generate(session, PROMPT, 10) == reference(PROMPT, 10)
        # Three prefill chunks and ten steps crossed the boundary.
        assert len(edge.tail_engine.calls) == 3 + 10
        assert session.flow is not None and session.flow.max_prefill_chunk_tokens == 3


async def test_prefill_chunks_are_pipelined_within_the_granted_credit(edge: Edge) -> None:
    edge.head_engine.step_delay_s = 0.1  # long enough to look while the first chunk runs
    flow = shard.FlowControl(max_prefill_chunk_tokens=1, max_inflight_chunks=3, credits_granted=3)
    async with edge.open(config=ClientConfig(proposed_flow_control=flow)) as session:
        handles = session.submit_prefill(PROMPT)
        await eventually(lambda: len(edge.head_engine.calls) >= 1)
        # Three units on the wire, the rest waiting for credit.
        assert (session.client.unacked, session.client.pending) == (3, len(PROMPT) - 3)
        outputs = [await h for h in handles]
        assert outputs[-1].token == reference(PROMPT, 0)[0]
        assert [o.token for o in outputs[:-1]] == [None] * (len(PROMPT) - 1)


async def test_decode_steps_are_pipelined_and_answered_in_order(edge: Edge) -> None:
    expected = reference(PROMPT, 8)
    async with edge.open() as session:
        assert (await session.prefill(PROMPT)).token == expected[0]
        edge.tail_engine.step_delay_s = 0.05
        # Teacher-forced with known tokens, so every step can go out before the first answer.
        handles = [
            session.submit_decode(token, position=len(PROMPT) + i) for i, token in enumerate(expected[:-1])
        ]
        await eventually(lambda: len(edge.tail_engine.calls) > 1)
        assert session.client.unacked > 1  # several steps in flight at once
        outputs = [await handle for handle in handles]
        assert [o.token for o in outputs] == expected[1:]
        assert [o.step for o in outputs] == sorted(o.step for o in outputs)


async def test_a_unit_in_flight_when_the_link_dies_is_resent_and_answered_as_a_duplicate(edge: Edge) -> None:
    expected = reference(PROMPT, 2)
    async with edge.open() as session:
        assert (await session.prefill(PROMPT)).token == expected[0]
        edge.head_engine.step_delay_s = 0.5  # still computing when the link dies
        decode = asyncio.ensure_future(session.decode(expected[0], position=len(PROMPT)))
        calls = len(edge.head_engine.calls)
        await eventually(lambda: len(edge.head_engine.calls) > calls)  # the head is computing it
        link = session.link
        assert link is not None
        link.close("cable pulled")  # the stream dies with the link; the factory dials a new one
        output = await decode
        assert output.token == expected[1] and output.duplicate
        assert session.link is not link
        # Applied once on each hop although it was sent twice.
        assert len(edge.head_engine.calls) == calls + 1
        assert len(edge.tail_engine.calls) == 2
        edge.head_engine.step_delay_s = 0.0
        assert (await session.decode(expected[1], position=len(PROMPT) + 1)).token == expected[2]


async def test_an_out_of_band_cancel_interrupts_a_sender_blocked_on_credit(edge: Edge) -> None:
    edge.head_engine.step_delay_s = 5.0  # the first chunk runs until something interrupts it
    flow = shard.FlowControl(max_prefill_chunk_tokens=1, max_inflight_chunks=1, credits_granted=1)
    async with edge.open(config=ClientConfig(proposed_flow_control=flow)) as session:
        handles = session.submit_prefill(PROMPT)
        await eventually(lambda: len(edge.head_engine.calls) == 1)
        assert session.client.pending == len(PROMPT) - 1  # blocked: no credit until the first answers
        streams_before = edge.head.streams_accepted
        assert await session.cancel() == 1  # the running chunk, interrupted on the worker
        assert edge.head.streams_accepted == streams_before + 1  # it came on a fresh stream
        for handle in handles:
            with pytest.raises(ShardProtocolError) as failure:
                await handle
            assert failure.value.code == shard.ERROR_CODE_CANCELLED
        await eventually(lambda: edge.head_engine.metrics()[METRIC_STEPS_CANCELLED] == 1)
        assert len(edge.head_engine.calls) == 1 and not edge.tail_engine.calls


async def test_a_deadline_already_past_is_refused_by_the_worker(edge: Edge) -> None:
    async with edge.open() as session:
        with pytest.raises(ShardProtocolError) as failure:
            await session.prefill(PROMPT, deadline_unix_ns=time.time_ns() - 1)
        assert failure.value.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
        assert not failure.value.retryable
        assert failure.value.detail == "deadline passed before the unit finished"  # the worker's words
        assert not edge.head_engine.calls


async def test_a_killed_worker_surfaces_a_transport_error_by_the_deadline(edge: Edge) -> None:
    async with edge.open(options=SessionConfig(max_reconnects=1, reconnect_backoff_s=0.01)) as session:
        first = (await session.prefill(PROMPT)).token
        edge.head.kill()
        with pytest.raises(SessionTransportError):
            await session.decode(first, position=len(PROMPT), deadline_unix_ns=time.time_ns() + SECOND)
        assert session.closed


async def test_a_silent_worker_fails_the_unit_shortly_after_its_deadline(edge: Edge) -> None:
    # A grace far longer than the worker needs to say DEADLINE_EXCEEDED, even on a loaded machine.
    config = ClientConfig(answer_grace_ns=2 * SECOND)
    async with edge.open(config=config) as session:
        first = (await session.prefill(PROMPT)).token
        edge.head_engine.step_delay_s = 5.0  # wedged: never answers in time
        deadline = time.time_ns() + SECOND // 5
        with pytest.raises(ShardProtocolError) as failure:
            await session.decode(first, position=len(PROMPT), deadline_unix_ns=deadline)
        # The worker cut the running step at the deadline and said so before the client gave up.
        assert failure.value.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
        await eventually(lambda: edge.head_engine.metrics()[METRIC_STEPS_CANCELLED] == 1)


async def test_an_unreachable_next_hop_is_internal_and_retryable(edge: Edge) -> None:
    edge.tail.kill()
    options = SessionConfig(max_reconnects=0, reconnect_backoff_s=0.01)
    edge.head_server.config = replace(edge.head_server.config, downstream_options=options)
    async with edge.open() as session:
        with pytest.raises(ShardProtocolError) as failure:
            await session.prefill(PROMPT)
        assert failure.value.code == shard.ERROR_CODE_INTERNAL and failure.value.retryable
        assert failure.value.detail == "next hop unreachable"


async def test_an_engine_crash_is_internal_to_the_peer_and_explained_in_the_nodes_log(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def crash(steps: object) -> list[object]:
        raise RuntimeError("tensor 'blk.3.attn_q' lost its buffer")

    monkeypatch.setattr(edge.tail_engine, "step_batch", crash)
    with caplog.at_level("INFO", logger="meshnode.dataplane"):
        async with edge.open() as session:
            with pytest.raises(ShardProtocolError) as failure:
                await session.prefill(PROMPT)
    assert failure.value.code == shard.ERROR_CODE_INTERNAL
    assert failure.value.detail == "next hop refused: ERROR_CODE_INTERNAL"
    # The peer hears a code; the operator's log says what happened, with its traceback.
    [record] = [r for r in caplog.records if r.name == "meshnode.dataplane.failure_log"]
    assert record.levelname == "ERROR" and "a batch of 1 step(s)" in record.getMessage()
    assert record.exc_info is not None and "lost its buffer" in str(record.exc_info[1])
    # ...and the node keeps serving once the engine does.
    monkeypatch.undo()
    async with edge.open() as session:
        assert await generate(session, PROMPT, 3) == reference(PROMPT, 3)


async def test_a_refused_open_raises_the_exact_code(edge: Edge) -> None:
    wrong = shard.Fingerprint(model_artifact_digest="other", runtime_recipe_digest="recipe")
    with pytest.raises(ShardProtocolError) as failure:
        await edge.open(fingerprint=wrong)
    assert failure.value.code == shard.ERROR_CODE_FINGERPRINT_MISMATCH
    with pytest.raises(ShardProtocolError) as failure:
        await edge.open(shard_range=srange(0, 3))
    assert failure.value.code == shard.ERROR_CODE_SHARD_RANGE_MISMATCH


async def test_closing_a_session_releases_it_on_every_hop(edge: Edge) -> None:
    async with edge.open() as session:
        await session.prefill(PROMPT)
        assert edge.head_server.load().active_sessions == 1
        assert edge.tail_server.load().active_sessions == 1
        key = (session.route_session_id, session.route_epoch)
    await eventually(lambda: edge.tail_server.load().active_sessions == 0)
    assert edge.head_server.load().active_sessions == 0
    await eventually(lambda: len(edge.head_engine.released) == len(edge.tail_engine.released) == 1)
    assert [(k.session_id, k.epoch) for k in edge.head_engine.released] == [key]
    assert [(k.session_id, k.epoch) for k in edge.tail_engine.released] == [key]


async def test_unary_capability_health_and_release(edge: Edge) -> None:
    link = await edge.client.get_link(edge.head.node_id)
    report = await rpc.get_capability(link)
    assert report.validated and report.validated_at_unix_nanos > 0
    assert (report.shard_range.start_layer, report.shard_range.end_layer) == (0, 2)
    assert report.fingerprint.model_artifact_digest == FP.model_artifact_digest
    async with edge.open() as session:
        await session.prefill(PROMPT)
        health = await rpc.get_health(link)
        assert health.state == shard.SERVING_STATE_SERVING and health.active_sessions == 1
        assert health.resident_bytes > 0
        assert await session.release(out_of_band=True) is True
        assert await session.release(out_of_band=True) is False  # idempotent
    assert (await rpc.get_health(link)).active_sessions == 0


async def test_garbage_on_a_session_stream_is_refused_and_the_worker_keeps_serving(edge: Edge) -> None:
    link = await edge.client.get_link(edge.head.node_id)
    stream = await link.open_stream(StreamType.SHARD_SESSION)
    await stream.send_frame(b"\xff\xff\xff not a route")
    reply = await stream.recv_frame(2.0)
    assert reply is not None
    status = shard.SessionResponse.FromString(reply).status
    assert status.terminal and status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert await stream.recv_frame(2.0) is None  # then the worker ends the stream
    async with edge.open() as session:
        assert (await session.prefill(PROMPT)).token == reference(PROMPT, 0)[0]


async def test_a_truncated_unary_request_is_refused_with_a_mesh_code(edge: Edge) -> None:
    link = await edge.client.get_link(edge.head.node_id)
    stream = await link.open_stream(StreamType.SHARD_HEALTH)
    stream.finish()
    with pytest.raises(Exception) as failure:
        await stream.recv_frame(2.0)
    assert getattr(failure.value, "error_code", None) == reset_code(mesh.MESH_ERROR_MALFORMED)


async def test_a_stopping_server_ends_its_sessions_with_a_transport_error(edge: Edge) -> None:
    options = SessionConfig(max_reconnects=1, reconnect_backoff_s=0.01)
    async with edge.open(options=options, config=default_client_config()) as session:
        first = (await session.prefill(PROMPT)).token
        await edge.head_server.aclose()
        with pytest.raises(SessionTransportError):
            await session.decode(first, position=len(PROMPT), deadline_unix_ns=time.time_ns() + SECOND)


async def test_hidden_state_sessions_return_hidden_states(edge: Edge) -> None:
    """A route that ends at a non-tail worker returns its hidden states (a head probing one shard)."""
    link = await edge.client.get_link(edge.head.node_id)
    async with ShardSession.open(link, fingerprint=FP, shard_range=srange(0, 2)) as session:
        output = await session.prefill(PROMPT)
        assert output.token is None
        assert output.hidden is not None and output.hidden.shape == (len(PROMPT), 8)
        assert output.hidden.dtype == np.float32 and np.isfinite(output.hidden).all()
