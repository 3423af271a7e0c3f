"""SIGTERM drains: in-flight generations complete, new work is refused, then the node leaves.

Three real node processes on the tiny model: A serves [0, 3) and the API, B and
B2 both serve [3, 6). A generation is streaming through A and B when B gets
SIGTERM: B reports SERVING_STATE_DRAINING, refuses a new session, lets the
running one finish (the text is still the unsplit model's greedy text), then
exits cleanly and its peers drop it at once. Then A gets SIGTERM mid-generation:
its API refuses new requests with 503 while the running one completes.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.node_processes import QuicCluster, api_node_args
from helpers.polling import eventually
from helpers.tiny_llama import load_engine

from engines.interface import GREEDY, SessionKey, StepRequest
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from engines.tokenizer import Tokenizer
from meshnode.dataplane.edges import rpc
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = "the mesh drains gracefully when"
TOKENS = 200
MODEL = "meshnode-tiny-llama-v1"


SPLITS = {"A": (0, 3), "B": (3, TINY_N_LAYERS), "B2": (3, TINY_N_LAYERS)}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[QuicCluster]:
    """A serves the API; every node drains for up to 60 s."""
    node_args = api_node_args(SPLITS, ["A"], "--drain-timeout", "60")
    cluster = QuicCluster(tmp_path_factory.mktemp("drain"), tiny_model, node_args)
    with cluster.running(SPLITS):
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> str:
    tokenizer = Tokenizer.open(tiny_model)
    engine = load_engine(tiny_model, 0, TINY_N_LAYERS)
    prompt = tokenizer.encode_prompt(PROMPT)
    key = SessionKey("reference", 1)
    tokens = [int(engine.prefill(StepRequest(key, 0, token_ids=tuple(prompt), sampling=GREEDY)).token_id)]
    while len(tokens) < TOKENS and not tokenizer.is_end_of_generation(tokens[-1]):
        position = len(prompt) + len(tokens) - 1
        step = StepRequest(
            key, position, token_ids=(tokens[-1],), expected_past_len=position, sampling=GREEDY
        )
        tokens.append(int(engine.decode(step).token_id))
    engine.close()
    stream = tokenizer.detokenizer()
    kept = [t for t in tokens if not tokenizer.is_end_of_generation(t)]
    return "".join(stream.feed(t) for t in kept) + stream.flush()


async def api_ready(api: str, cluster: QuicCluster, peers: int) -> None:
    async with asyncio.timeout(60), aiohttp.ClientSession() as session:
        while True:
            status = cluster.named("A").status()
            async with session.get(f"{api}/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            if status is not None and len(status["peers"]) >= peers and listed == [MODEL]:
                return
            await asyncio.sleep(0.1)


class StreamingCompletion:
    """A greedy streamed completion through A's API; ``started`` is set after a few chunks."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.pieces: list[str] = []
        self.started = asyncio.Event()
        self.done = False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> str:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.api}/v1/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            async for line in r.content:
                data = line.strip().removeprefix(b"data: ")
                if data and data != b"[DONE]":
                    self.pieces.append(json.loads(data)["choices"][0]["text"])
                    if len(self.pieces) >= 5:
                        self.started.set()
        self.done = True
        return "".join(self.pieces)


async def test_a_draining_worker_finishes_its_session_refuses_new_ones_then_leaves(
    cluster, reference, tmp_path
):
    a, b = cluster.named("A"), cluster.named("B")
    api = a.status()["node"]["api_url"]
    await api_ready(api, cluster, peers=2)
    client = await cluster.client_node(tmp_path / "client")
    try:
        b_id = b.node_id()
        link = await client.get_link(b_id)
        fingerprint = next(
            p.announcement.serving.fingerprint for p in client.peers() if p.announcement.endpoint_id == b_id
        )
        # B2 serves the same layers: stop it so the generation certainly runs through B.
        cluster.named("B2").stop()
        await eventually(lambda: len(a.status()["peers"]) == 2, 30)  # B and the client

        generation = StreamingCompletion(api)
        await asyncio.wait_for(generation.started.wait(), 30)
        b.process.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            health = await rpc.get_health(link)
            return health.state == shard.SERVING_STATE_DRAINING

        await eventually(draining, 10)
        with pytest.raises(ShardProtocolError) as refused:
            async with ShardSession.open(
                link,
                fingerprint=fingerprint,
                shard_range=shard.ShardRange(start_layer=3, end_layer=TINY_N_LAYERS, effective_start_layer=3),
            ):
                pass
        checked_while_running = not generation.done
        assert refused.value.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
        assert "draining" in refused.value.detail

        text = await asyncio.wait_for(generation.task, 60)
        assert checked_while_running, "the generation ended before the drain could be observed"
        assert text == reference
        assert b.process.wait(30) == 0
        log = b.log_path.read_text()
        assert "drained: no work in flight" in log
        assert log.index("draining:") < log.index("drained:") < log.index("telling peers we are leaving")
        await eventually(lambda: b_id.hex() not in {p["id"] for p in a.status()["peers"]}, 10)
    finally:
        await client.shutdown()


async def test_a_draining_head_refuses_new_requests_and_finishes_the_running_one(cluster, reference):
    a = cluster.named("A")
    b2 = cluster.named("B2")
    b2.start("start", *cluster.serve_args("B2", 3, TINY_N_LAYERS))
    b2.wait_ready()
    api = a.status()["node"]["api_url"]
    await api_ready(api, cluster, peers=1)
    generation = StreamingCompletion(api)
    await asyncio.wait_for(generation.started.wait(), 30)
    a.process.send_signal(signal.SIGTERM)
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):
            while True:
                body = {"model": MODEL, "prompt": "new", "max_tokens": 2}
                async with session.post(f"{api}/v1/completions", json=body) as r:
                    if r.status == 503:
                        assert "draining" in (await r.json())["error"]["message"]
                        break
                await asyncio.sleep(0.02)
    checked_while_running = not generation.done
    assert await asyncio.wait_for(generation.task, 60) == reference
    assert checked_while_running, "the generation ended before the drain could be observed"
    assert a.process.wait(30) == 0
