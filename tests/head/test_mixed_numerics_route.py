"""A real route across two llama.cpp hops that compute differently: weight repacking on one, off on the other.

Three in-process mesh nodes over real QUIC: B serves layers [0, 3) of the tiny model
with weight repacking, C serves [3, 6) without, and A, serving nothing, plans its
route from gossip and answers the OpenAI API. The two hops share one fingerprint
(the hop contract) and announce different numerics, so they must form one route.
The tiny model's weights are F32 (safe to load with repacking on any CPU; llama.cpp
repacks only quantized types), so the text must equal the unsplit model's, while the
response, the driver's stats and ``meshnode status`` name both numerics.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually
from helpers.tiny_llama import CTX, THREADS, load_engine, run_unsplit

from engines.interface import GREEDY, LoadRequest
from engines.llama_engine import LlamaShardEngine, runtime_numerics
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from engines.tokenizer import Tokenizer
from meshnode.app.head_service import HeadConfig, HeadService
from meshnode.app.shard_service import served_shard
from meshnode.dataplane.edges.server import ShardServer
from meshnode.head.driver import DriverConfig
from meshnode.head.environment import NodeRoutes
from meshnode.head.numerics import system_fingerprint
from meshnode.head.planner import Hop, Route
from meshnode.node import Node
from meshnode.wire.pb import mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SPLIT = 3
PROMPT = "hello world, the mesh"
TOKENS = 16
REPACKED = runtime_numerics("cpu", True)
PLAIN = runtime_numerics("cpu", False)


@dataclass
class Pool:
    head: Node
    shards: dict[str, Node]
    servers: list[ShardServer]
    service: HeadService


async def serve_shard(node: Node, model: Path, start: int, end: int, *, weight_repack: bool) -> ShardServer:
    """What the shard service does for ``--model --layers``, with the repack setting chosen here."""
    engine = LlamaShardEngine()
    server = ShardServer(engine, links=node.get_link, owns_engine=True)
    request = LoadRequest(
        str(model), start, end, n_ctx=CTX, n_seq_max=2, n_threads=THREADS, weight_repack=weight_repack
    )
    caps = await server.engine_thread.call(engine.load, request)
    assert (await server.start()).validated
    server.register(node.register_handler)
    node.set_serving(served_shard(caps, model.stem))
    node.set_capacity(mesh.Capacity(max_concurrent_sessions=2, max_context_tokens=CTX))
    return server


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    model = ensure_tiny_model()
    head = await start_first_node(tmp_path, "a")
    shards = {"b": await start_joiner(tmp_path, "b", head), "c": await start_joiner(tmp_path, "c", head)}
    servers: list[ShardServer] = []
    service: HeadService | None = None
    try:
        servers.append(await serve_shard(shards["b"], model, 0, SPLIT, weight_repack=True))
        servers.append(await serve_shard(shards["c"], model, SPLIT, TINY_N_LAYERS, weight_repack=False))
        served = shards["b"].state.local.serving
        options = HeadConfig(api_host="127.0.0.1", api_port=0, driver=DriverConfig(open_timeout_s=10.0))
        service = await HeadService.start(NodeRoutes(head), model_path=model, served=served, options=options)
        await eventually(service.backend.model_names, 30)  # gossip has brought both shards to A
        yield Pool(head, shards, servers, service)
    finally:
        if service is not None:
            await service.aclose()
        for server in servers:
            await server.aclose()
        for node in [head, *shards.values()]:
            await node.shutdown()


def reference_text(model: Path, tokenizer: Tokenizer) -> tuple[list[int], str]:
    """The unsplit model's greedy tokens for PROMPT, and their text up to an end of generation."""
    engine = load_engine(model, 0, TINY_N_LAYERS)
    try:
        prompt = tokenizer.encode_prompt(PROMPT)
        tokens, _ = run_unsplit(engine, prompt, chunk_tokens=128, decode_steps=TOKENS - 1)
    finally:
        engine.close()
    stream = tokenizer.detokenizer()
    text = []
    for token in tokens:
        if tokenizer.is_end_of_generation(token):
            break
        text.append(stream.feed(token))
    return tokens, "".join(text) + stream.flush()


def uniform(route: Route, numerics: str) -> Route:
    """The same route as if every hop computed alike."""
    hops = tuple(
        Hop(h.node_id, h.start_layer, h.end_layer, h.effective_start_layer, numerics) for h in route.hops
    )
    return Route(route.model, route.model_name, hops)


async def test_hops_with_different_weight_repack_settings_give_the_unsplit_text_and_report_both(pool: Pool):
    model = ensure_tiny_model()
    tokenizer = Tokenizer.open(model)
    try:
        expected_tokens, expected_text = reference_text(model, tokenizer)
        prompt = tokenizer.encode_prompt(PROMPT)
    finally:
        tokenizer.close()
    driver = pool.service.driver
    (identity,) = {candidate.model for candidate in driver.env.candidates()}
    assert {c.numerics for c in driver.env.candidates()} == {REPACKED, PLAIN}

    stream = driver.generate(identity, prompt, sampling=GREEDY, max_tokens=TOKENS)
    assert [token async for token in stream] == expected_tokens
    assert stream.route is not None
    assert [hop.node_id for hop in stream.route.hops] == [pool.shards["b"].node_id, pool.shards["c"].node_id]
    assert [hop.numerics for hop in stream.route.hops] == [REPACKED, PLAIN]
    assert driver.stats.last_route_numerics == (REPACKED, PLAIN)
    fingerprint = system_fingerprint(stream.route)
    assert stream.system_fingerprint == fingerprint != system_fingerprint(uniform(stream.route, PLAIN))

    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{pool.service.url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        answer = await r.json()
    assert answer["choices"][0]["text"] == expected_text
    assert answer["system_fingerprint"] == fingerprint

    peers = {peer.id: peer.serving for peer in pool.head.status().peers}
    served_b, served_c = peers[pool.shards["b"].node_id.hex()], peers[pool.shards["c"].node_id.hex()]
    assert served_b is not None and served_b.numerics == REPACKED
    assert served_c is not None and served_c.numerics == PLAIN
