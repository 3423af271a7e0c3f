"""Acceptance: a two-shard llama.cpp chain driven like the head will, over real QUIC between two
``meshnode`` processes and over the in-process loopback transport, by the same test code.

The client opens a session to the ``[0, 3)`` worker with a route naming the
``[3, 6)`` worker downstream, so activations flow worker to worker; the route
asks for the tail's logits, which are compared with an unsplit in-process
llama.cpp engine fed the same prefill chunks.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.loopback_mesh import LoopbackMesh
from helpers.mesh_nodes import serving_peer
from helpers.node_processes import QuicCluster
from helpers.polling import eventually
from helpers.tiny_llama import CTX, SPLIT, THREADS, load_engine, run_unsplit

from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.dataplane.client import ClientConfig
from meshnode.dataplane.edges import rpc
from meshnode.dataplane.edges.shard_session import SessionConfig, ShardSession, default_client_config
from meshnode.dataplane.errors import SessionTransportError
from meshnode.transport.base import PeerLink
from meshnode.wire.cpu_mask import cpus_of_mask
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

from .chain_fixtures import ChainUnderTest, LoopbackChain, quic_chain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SECOND = 1_000_000_000
CHUNK_TOKENS = 16
PROMPT_TOKENS = 40  # three chunks: 16 + 16 + 8
DECODE_STEPS = 20


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def whole_model(tiny_model: Path) -> Iterator[LlamaShardEngine]:
    engine = load_engine(tiny_model, 0, TINY_N_LAYERS)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(whole_model: LlamaShardEngine) -> list[int]:
    vocab = whole_model.capabilities().vocab_size
    return [int(t) for t in np.random.default_rng(5).integers(3, vocab, size=PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def unsplit(whole_model: LlamaShardEngine, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    return run_unsplit(whole_model, prompt, chunk_tokens=CHUNK_TOKENS, decode_steps=DECODE_STEPS)


# ---------------------------------------------------------------------------- the chain, two ways


MAX_SESSIONS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[QuicCluster]:
    # Sessions fixed, not auto (the command line's default, sized by the KV budget): the
    # announced capacity is asserted below.
    sized = {name: ["--max-sessions", str(MAX_SESSIONS)] for name in ("head", "tail")}
    cluster = QuicCluster(tmp_path_factory.mktemp("cluster"), tiny_model, sized)
    with cluster.running({"head": (0, SPLIT), "tail": (SPLIT, TINY_N_LAYERS)}):
        yield cluster


@pytest.fixture(scope="module")
def loopback_engines(tiny_model: Path) -> Iterator[tuple[LlamaShardEngine, LlamaShardEngine]]:
    head, tail = load_engine(tiny_model, 0, SPLIT), load_engine(tiny_model, SPLIT, TINY_N_LAYERS)
    yield head, tail
    head.close()
    tail.close()


async def joined_chain(cluster: QuicCluster, data_dir: Path) -> AsyncIterator[ChainUnderTest]:
    """The test process joins the cluster's mesh as a client node, as a head would."""
    node = await cluster.client_node(data_dir)
    try:
        yield await quic_chain(node)
    finally:
        await node.shutdown()


@pytest.fixture(params=["quic", "loopback"])
async def chain(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ChainUnderTest]:
    if request.param == "quic":
        async for joined in joined_chain(request.getfixturevalue("cluster"), tmp_path / "client"):
            yield joined
    else:
        head, tail = request.getfixturevalue("loopback_engines")
        loopback = LoopbackChain(head, tail)
        try:
            yield await loopback.start()
        finally:
            await loopback.aclose()


def chunked() -> ClientConfig:
    flow = shard.FlowControl(max_prefill_chunk_tokens=CHUNK_TOKENS)
    return ClientConfig(proposed_flow_control=flow, answer_grace_ns=default_client_config().answer_grace_ns)


async def generate(
    session: ShardSession, prompt: list[int], forced: list[int] | None = None
) -> tuple[list[int], list[np.ndarray]]:
    tokens: list[int] = []
    logits: list[np.ndarray] = []

    def keep(token: int | None, row: np.ndarray | None) -> None:
        assert token is not None and row is not None
        tokens.append(token)
        logits.append(row)

    first = await session.prefill(prompt)
    assert len(first.chunks) == 3
    keep(first.token, first.logits)
    position = len(prompt)
    for step in range(DECODE_STEPS):
        fed = tokens[-1] if forced is None else forced[step]
        output = await session.decode(fed, position=position)
        keep(output.token, output.logits)
        position += 1
    return tokens, logits


# ---------------------------------------------------------------------------- acceptance


async def test_a_float32_split_chain_gives_the_unsplit_models_logits(
    chain: ChainUnderTest, prompt: list[int], unsplit: tuple[list[int], list[np.ndarray]]
) -> None:
    async with chain.open(return_logits=True, config=chunked()) as session:
        tokens, logits = await generate(session, prompt)
    expected_tokens, expected_logits = unsplit
    assert tokens == expected_tokens
    assert len(logits) == DECODE_STEPS + 1
    for got, want in zip(logits, expected_logits, strict=True):
        np.testing.assert_array_equal(got, want)


async def test_a_bfloat16_boundary_reports_agreement_and_logit_error(
    chain: ChainUnderTest,
    prompt: list[int],
    unsplit: tuple[list[int], list[np.ndarray]],
    record_property: pytest.RecordProperty,
) -> None:
    expected_tokens, expected_logits = unsplit
    # Teacher-forced with the unsplit model's tokens, so every position compares like with like.
    async with chain.open(
        return_logits=True, boundary_dtype=shard.DTYPE_BFLOAT16, config=chunked()
    ) as session:
        tokens, logits = await generate(session, prompt, forced=expected_tokens)
    agreement = sum(a == b for a, b in zip(tokens, expected_tokens, strict=True)) / len(tokens)
    # Largest error relative to each position's logit scale (per-element ratios explode near zero).
    error = max(
        float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        for got, want in zip(logits, expected_logits, strict=True)
    )
    record_property("bf16_greedy_agreement", agreement)
    record_property("bf16_max_relative_logit_error", error)
    print(
        f"[{chain.transport}] bfloat16 boundary: greedy agreement {agreement:.3f}, max relative logit error {error:.2e}"
    )
    assert 0 < error < 0.05  # it really rounded, and only a little
    assert agreement >= 0.9


async def test_a_duplicated_decode_step_is_a_duplicate_and_the_output_stays_identical(
    chain: ChainUnderTest, prompt: list[int], unsplit: tuple[list[int], list[np.ndarray]]
) -> None:
    expected_tokens, expected_logits = unsplit
    async with chain.open(return_logits=True, config=chunked()) as session:
        assert (await session.prefill(prompt)).token == expected_tokens[0]
        position = len(prompt)
        first = await session.decode(expected_tokens[0], position=position)
        assert first.token == expected_tokens[1] and not first.duplicate
        # The same step again on another stream of the same session, as after a lost answer:
        # same idempotency step, same work id.
        duplicate_sender = await chain.open(
            return_logits=True,
            route_session_id=session.route_session_id,
            first_step=first.step,
            config=chunked(),
        )
        try:
            again = await duplicate_sender.decode(expected_tokens[0], position=position)
        finally:
            await duplicate_sender.aclose(release=False)
        assert again.duplicate and again.step == first.step and again.work_id == first.work_id
        assert again.token == first.token
        np.testing.assert_array_equal(again.logits, first.logits)
        # The caches advanced once: the following steps are still the unsplit model's.
        token = first.token
        for step in range(1, 6):
            output = await session.decode(token, position=position + step)
            assert output.token == expected_tokens[step + 1]
            np.testing.assert_array_equal(output.logits, expected_logits[step + 1])
            token = output.token


async def test_a_deadline_already_past_is_refused(chain: ChainUnderTest, prompt: list[int]) -> None:
    async with chain.open(config=chunked()) as session:
        with pytest.raises(ShardProtocolError) as failure:
            await session.prefill(prompt, deadline_unix_ns=time.time_ns() - SECOND)
        assert failure.value.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
        assert not failure.value.retryable
        assert failure.value.detail == "deadline passed before the unit finished"  # refused by the worker


async def test_an_out_of_band_cancel_interrupts_a_sender_blocked_on_credits(
    chain: ChainUnderTest, whole_model: LlamaShardEngine
) -> None:
    vocab = whole_model.capabilities().vocab_size
    long_prompt = [int(t) for t in np.random.default_rng(9).integers(3, vocab, size=400)]
    flow = shard.FlowControl(max_prefill_chunk_tokens=8, max_inflight_chunks=1, credits_granted=1)
    async with chain.open(config=ClientConfig(proposed_flow_control=flow)) as session:
        handles = session.submit_prefill(long_prompt)
        assert len(handles) == 50
        await handles[0]
        # One chunk in flight, the other 48 wait for credit that only the worker's answers return.
        assert session.client.pending >= 47
        cancelled = await session.cancel(reason="client went away")
        assert cancelled in (0, 1)  # the chunk in flight, if it was still running
        outcomes = []
        for handle in handles[1:]:
            try:
                await handle
                outcomes.append("done")
            except ShardProtocolError as error:
                outcomes.append(shard.ErrorCode.Name(error.code))
        # At most the chunk already in flight got through; everything behind it was cancelled.
        assert outcomes[1:] == ["ERROR_CODE_CANCELLED"] * 48
        assert outcomes[0] in ("done", "ERROR_CODE_CANCELLED")
        # The workers hold only what ran before the cancel.
        with pytest.raises(ShardProtocolError) as failure:
            await session.decode(5, position=len(long_prompt))
        assert failure.value.code == shard.ERROR_CODE_CACHE_MISS
        assert failure.value.actual_past_len <= 16


async def test_capability_reports_the_validated_range(chain: ChainUnderTest) -> None:
    link = await chain.links()
    report = await rpc.get_capability(link)
    assert report.validated and report.validated_at_unix_nanos > 0
    assert (report.shard_range.start_layer, report.shard_range.end_layer) == (0, SPLIT)
    assert report.fingerprint == chain.fingerprint
    health = await rpc.get_health(link)
    assert health.state == shard.SERVING_STATE_SERVING and health.resident_bytes > 0


@pytest.fixture
async def quic_only(cluster: QuicCluster, tmp_path: Path) -> AsyncIterator[ChainUnderTest]:
    async for joined in joined_chain(cluster, tmp_path / "client"):
        yield joined


async def test_the_served_shards_are_announced_with_capacity_and_live_load(
    quic_only: ChainUnderTest, prompt: list[int]
) -> None:
    """What the processes gossip (QUIC cluster only: announcements travel in mesh gossip)."""
    chain = quic_only
    assert chain.node is not None
    entries = {entry.peer_id: entry.announcement for entry in chain.node.peers()}
    head, tail = entries[chain.head_id], entries[chain.tail_id]
    assert head.serving.model_name == tail.serving.model_name == "meshnode-tiny-llama-v1"
    assert (head.serving.total_layers, tail.serving.total_layers) == (TINY_N_LAYERS, TINY_N_LAYERS)
    assert (tail.serving.shard_range.start_layer, tail.serving.shard_range.end_layer) == (
        SPLIT,
        TINY_N_LAYERS,
    )
    assert head.serving.fingerprint.model_artifact_digest  # the engine's digest of the GGUF
    assert (head.capacity.max_concurrent_sessions, head.capacity.max_context_tokens) == (MAX_SESSIONS, CTX)
    assert head.load.serving_state == shard.SERVING_STATE_SERVING
    # What a head tells nodes with cores of their own by (meshnode.head.pipeline): the node's
    # --threads, and the CPUs its process may run on (inherited from this one).
    assert (head.serving.compute_threads, tail.serving.compute_threads) == (THREADS, THREADS)
    assert (
        cpus_of_mask(head.serving.cpu_mask) == cpus_of_mask(tail.serving.cpu_mask) == os.sched_getaffinity(0)
    )

    def head_load() -> tuple[int, float]:
        assert chain.node is not None
        load = next(e.announcement.load for e in chain.node.peers() if e.peer_id == chain.head_id)
        return load.active_sessions, load.kv_pressure

    async with chain.open(config=chunked()) as session:
        await session.prefill(prompt)
        # The load is refreshed from the worker and gossiped with the heartbeats.
        await eventually(lambda: head_load()[0] == 1 and head_load()[1] > 0, 10)


# ---------------------------------------------------------------------------- a worker that dies


@pytest.fixture(params=["quic", "loopback"])
async def doomed(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model: Path
) -> AsyncIterator[tuple[ChainUnderTest, Callable[[], None]]]:
    """A single worker serving the whole model, and a function that kills it like SIGKILL."""
    if request.param == "quic":
        cluster: QuicCluster = request.getfixturevalue("cluster")
        process = cluster.start_shard(f"doomed-{uuid.uuid4().hex[:6]}", 0, TINY_N_LAYERS)
        node = await cluster.client_node(tmp_path / "client")
        try:
            worker_id, fingerprint = await serving_peer(node, 0, TINY_N_LAYERS)

            async def link() -> PeerLink:
                return await node.get_link(worker_id)

            yield ChainUnderTest("quic", link, worker_id, b"", fingerprint), process.kill
        finally:
            process.kill()
            await node.shutdown()
    else:
        engine = load_engine(tiny_model, 0, TINY_N_LAYERS)
        loopback = LoopbackMesh()
        client, worker = loopback.add(1), loopback.add(2)
        from meshnode.dataplane.edges.server import ShardServer

        server = ShardServer(engine, links=worker.get_link, owns_engine=True)
        await server.start()
        server.register(worker.register_handler)
        try:
            yield (
                ChainUnderTest(
                    "loopback",
                    lambda: client.get_link(worker.node_id),
                    worker.node_id,
                    b"",
                    server.worker.fingerprint,
                ),
                worker.kill,
            )
        finally:
            await server.aclose()
            await loopback.aclose()


async def test_killing_the_worker_mid_session_is_a_transport_error_by_the_deadline(
    doomed: tuple[ChainUnderTest, Callable[[], None]], prompt: list[int]
) -> None:
    worker, kill = doomed
    options = SessionConfig(max_reconnects=1, reconnect_backoff_s=0.05)
    async with ShardSession.open(
        worker.links,
        fingerprint=worker.fingerprint,
        shard_range=shard.ShardRange(start_layer=0, end_layer=TINY_N_LAYERS, effective_start_layer=0),
        options=options,
    ) as session:
        first = (await session.prefill(prompt)).token
        kill()
        # Typed, and at the 2 s deadline plus the client's 0.25 s grace (room for a live worker's
        # own DEADLINE_EXCEEDED to arrive first), with slack for a loaded machine — never at the
        # 30 s transport idle timeout.
        with pytest.raises(SessionTransportError):
            async with asyncio.timeout(4):
                await session.decode(
                    first, position=len(prompt), deadline_unix_ns=time.time_ns() + 2 * SECOND
                )
