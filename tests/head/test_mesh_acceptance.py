"""Acceptance: real ``meshnode`` processes on the tiny model answer the OpenAI-compatible API.

Four node processes in one mesh over real QUIC: A serves layers [0, 2) and the
API, B and B2 both serve [2, 4) (B2 is the spare), C serves [4, 6). The test
process joins the mesh as a client node to ask each hop for its Health. The
reference is the unsplit model run in-process by llama.cpp with the same
tokenizer and chat template; the boundary is float32, so the text must be
identical, including after the middle node is killed mid-generation.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from dataplane.chain_fixtures import NodeProcess, QuicCluster, load_engine

from engines.interface import GREEDY, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from engines.tokenizer import Tokenizer
from meshnode.dataplane import rpc
from meshnode.identity import short_id
from meshnode.node import Node
from meshnode.wire.pb import shard

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MESSAGES = [{"role": "user", "content": "hello mesh, tell me about the model"}]
SPLITS = {"A": (0, 2), "B": (2, 4), "B2": (2, 4), "C": (4, TINY_N_LAYERS)}
MODEL = "meshnode-tiny-llama-v1"


API_NODES = ("A", "C")


class ApiCluster(QuicCluster):
    """The data plane's two-shard cluster, grown to four nodes; A and C serve the API."""

    def start_shard(self, name: str, start: int, end: int) -> NodeProcess:
        self._starting = name
        return super().start_shard(name, start, end)

    def _serve_args(self, start: int, end: int) -> list[str]:
        api = "127.0.0.1:0" if self._starting in API_NODES else "off"
        return [*super()._serve_args(start, end), "--api-listen", api, "--probe-timeout", "1"]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ApiCluster]:
    cluster = ApiCluster(tmp_path_factory.mktemp("mesh"), tiny_model)
    try:
        for name, (start, end) in SPLITS.items():
            cluster.start_shard(name, start, end)
        yield cluster
    finally:
        cluster.stop()


def process(cluster: ApiCluster, name: str) -> NodeProcess:
    return cluster.processes[list(SPLITS).index(name)]


@pytest.fixture(scope="module")
def api(cluster: ApiCluster) -> str:
    status = process(cluster, "A").status()
    assert status is not None and status["node"]["api_url"].startswith("http://127.0.0.1:")
    return status["node"]["api_url"]


@pytest.fixture
async def client_node(cluster: ApiCluster, tmp_path: Path) -> AsyncIterator[Node]:
    node = await cluster.client_node(tmp_path / "client")
    yield node
    await node.shutdown()


def node_ids(cluster: ApiCluster) -> dict[str, bytes]:
    ids = {}
    for name in SPLITS:
        status = process(cluster, name).status()
        assert status is not None
        ids[name] = bytes.fromhex(status["node"]["id"])
    return ids


async def route_ready(api: str, cluster: ApiCluster) -> None:
    """Every node sees every other one, and A's API lists the model (a complete route exists)."""
    ids = set(node_ids(cluster).values())
    async with asyncio.timeout(60), aiohttp.ClientSession() as session:
        while True:
            seen = all(
                ids - {bytes.fromhex(s["node"]["id"])} <= {bytes.fromhex(p["id"]) for p in s["peers"]}
                for s in (p.status() for p in cluster.processes if p.process.poll() is None)
                if s is not None
            )
            async with session.get(f"{api}/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            if seen and listed == [MODEL]:
                return
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[int, str]:
    """The unsplit model's greedy chat answer, by max_tokens."""
    tokenizer = Tokenizer.open(tiny_model)
    engine: LlamaShardEngine = load_engine(tiny_model, 0, TINY_N_LAYERS)
    prompt = tokenizer.encode_chat(MESSAGES)
    key = SessionKey("reference", 1)
    result = engine.prefill(StepRequest(key, 0, token_ids=tuple(prompt), sampling=GREEDY))
    tokens = [int(result.token_id)]  # type: ignore[arg-type]
    while len(tokens) < 300 and not tokenizer.is_end_of_generation(tokens[-1]):
        position = len(prompt) + len(tokens) - 1
        result = engine.decode(
            StepRequest(key, position, token_ids=(tokens[-1],), expected_past_len=position, sampling=GREEDY)
        )
        tokens.append(int(result.token_id))  # type: ignore[arg-type]
    engine.close()

    def text(count: int) -> str:
        stream = tokenizer.detokenizer()
        kept = [t for t in tokens[:count] if not tokenizer.is_end_of_generation(t)]
        return "".join(stream.feed(t) for t in kept) + stream.flush()

    return {count: text(count) for count in (24, 300)}


async def stream_chat(api: str, body: dict, *, on_chunk=None) -> tuple[str, dict]:
    """Streamed chat text and the usage chunk."""
    pieces, usage = [], {}
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            data = line.strip().removeprefix(b"data: ")
            if not data or data == b"[DONE]":
                continue
            event = json.loads(data)
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                if on_chunk is not None:
                    on_chunk(len(pieces))
    return "".join(pieces), usage


async def generations(api: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{api}/meshnode/generations") as r:
        return await r.json()


async def test_chat_completions_give_the_unsplit_models_greedy_text(api, cluster, reference):
    await route_ready(api, cluster)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        whole = await r.json()
    assert whole["choices"][0]["message"]["content"] == reference[24]
    assert whole["usage"]["completion_tokens"] == 24
    text, usage = await stream_chat(api, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert text == reference[24]
    assert usage == whole["usage"]
    stats = await generations(api)
    assert len(stats["last_route"]) == 3 and stats["reroutes"] == 0


async def scrape(api: str) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}, checking the exposition format."""
    async with aiohttp.ClientSession() as session, session.get(f"{api}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE "))
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


async def test_metrics_after_a_generation(api, cluster, reference):
    await route_ready(api, cluster)
    before = await scrape(api)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/chat/completions", json=body) as r:
        assert (await r.json())["choices"][0]["message"]["content"] == reference[24]
    after = await scrape(api)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("meshnode_tokens_generated_total") == 24
    assert delta('meshnode_generations_total{outcome="completed"}') == 1
    assert delta('meshnode_generations_total{outcome="failed"}') == 0
    # This node serves the first shard: one prefill, then a decode step per further token.
    assert delta('meshnode_engine_events_total{event="decode_steps"}') == 23
    assert delta('meshnode_engine_events_total{event="prefill_steps"}') >= 1
    assert after["meshnode_peers"] >= 2
    assert after['meshnode_serving_state{state="serving"}'] == 1
    assert after["meshnode_generations_active"] == 0
    assert 0 <= after["meshnode_kv_pressure"] <= 1 and after["meshnode_kv_tokens_capacity"] > 0
    errors = {k: v for k, v in after.items() if k.startswith("meshnode_shard_errors_total")}
    assert 'meshnode_shard_errors_total{code="CACHE_MISS"}' in errors and set(errors.values()) == {0.0}
    assert after["meshnode_tokens_per_second"] > 0


async def test_a_node_whose_shard_is_not_first_answers_through_a_remote_first_hop(api, cluster, reference):
    """C serves the last layers: its driver opens the session to A over QUIC, and the route's
    tail — C itself — hands the token back through B and A."""
    await route_ready(api, cluster)
    status = process(cluster, "C").status()
    assert status is not None
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{status['node']['api_url']}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == reference[24]


async def test_the_official_openai_client_works_unchanged(api, cluster, reference):
    await route_ready(api, cluster)
    client = openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="unused")
    try:
        assert [m.id for m in (await client.models.list()).data] == [MODEL]
        reply = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
        )
        assert reply.choices[0].message.content == reference[24]
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == reference[24]
        completion = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
        assert completion.usage.completion_tokens == 5
    finally:
        await client.close()


async def test_meshnode_generate_streams_from_the_local_nodes_api(api, cluster, reference):
    await route_ready(api, cluster)
    command = [
        sys.executable,
        "-m",
        "meshnode",
        "generate",
        "--data-dir",
        str(process(cluster, "A").data_dir),
    ]
    command += ["--prompt", MESSAGES[0]["content"], "--chat", "--max-tokens", "24", "--temperature", "0"]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference[24] + "\n"
    assert "24 tokens (length)" in done.stderr


async def test_a_client_disconnect_ends_the_generation_on_every_hop(api, cluster, client_node):
    await route_ready(api, cluster)
    before = await generations(api)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{api}/v1/chat/completions", json=body)
        for _ in range(4):
            await response.content.readline()
        response.close()  # hang up mid-generation
    async with asyncio.timeout(20):
        while (stats := await generations(api))["active"]:
            await asyncio.sleep(0.05)
    ended = {k: stats[k] - before[k] for k in ("completed", "cancelled", "closed", "tokens")}
    # The generation stopped early, cut by the disconnect rather than run to its 400 tokens.
    assert ended["completed"] == 0 and ended["cancelled"] + ended["closed"] == 1
    assert ended["tokens"] < 400
    if ended["cancelled"]:  # hung up while a step was running: the Cancel reached every hop
        report = stats["last_cancel"]
        assert sorted(report["cancel_acknowledged"]) == sorted(report["hops"])
    # Every hop, asked over QUIC: no session, nothing queued, nothing running.
    for name, node_id in node_ids(cluster).items():
        link = await client_node.get_link(node_id)
        async with asyncio.timeout(10):
            while True:
                health = await rpc.get_health(link)
                if health.active_sessions == health.queued_chunks == health.batch_occupancy == 0:
                    break
                await asyncio.sleep(0.05)
        assert health.state == shard.SERVING_STATE_SERVING, name


async def test_killing_the_middle_node_mid_generation_keeps_the_greedy_text(api, cluster, reference):
    await route_ready(api, cluster)
    short = {name: short_id(node_id) for name, node_id in node_ids(cluster).items()}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}
    twenty = asyncio.Event()
    before = await generations(api)
    streaming = asyncio.ensure_future(stream_chat(api, body, on_chunk=lambda n: n >= 20 and twenty.set()))
    async with asyncio.timeout(30):
        await twenty.wait()
    route = (await generations(api))["last_route"]
    (middle,) = [name for name in ("B", "B2") if short[name] in route]
    process(cluster, middle).process.send_signal(signal.SIGKILL)
    text, _ = await streaming
    after = await generations(api)
    assert after["tokens"] - before["tokens"] == 300, "the generation ended before the kill"
    assert after["reroutes"] - before["reroutes"] >= 1
    assert after["replay_mismatches"] == before["replay_mismatches"]
    assert text == reference[300]
    survivor = "B2" if middle == "B" else "B"
    assert short[survivor] in after["last_route"] and short[middle] not in after["last_route"]
