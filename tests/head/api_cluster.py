"""The four-node API cluster that the acceptance and crash-failover tests run on, and how they ask it.

Four ``meshnode`` processes in one mesh over real QUIC on the tiny model: A serves
layers [0, 2) and the API, B and B2 both serve [2, 4) (B2 is the spare), C serves
[4, 6) and the API too. The reference is the unsplit model run in-process by llama.cpp
with the same tokenizer and chat template.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
from helpers.node_processes import QuicCluster, api_node_args
from helpers.step_results import sampled_token
from helpers.tiny_llama import load_engine

from engines.interface import GREEDY, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS
from engines.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hello mesh, tell me about the model"}]
SPLITS = {"A": (0, 2), "B": (2, 4), "B2": (2, 4), "C": (4, TINY_N_LAYERS)}
MODEL = "meshnode-tiny-llama-v1"
API_NODES = ("A", "C")


def cluster_node_args() -> dict[str, list[str]]:
    """A and C serve the API; every node gives up on a probe after 1 s."""
    return api_node_args(SPLITS, API_NODES, "--probe-timeout", "1")


def unsplit_chat_answers(model: Path) -> dict[int, str]:
    """The unsplit model's greedy chat answer to MESSAGES, by max_tokens (24 and 300)."""
    tokenizer = Tokenizer.open(model)
    engine: LlamaShardEngine = load_engine(model, 0, TINY_N_LAYERS)
    prompt = tokenizer.encode_chat(MESSAGES)
    key = SessionKey("reference", 1)
    result = engine.prefill(StepRequest(key, 0, token_ids=tuple(prompt), sampling=GREEDY))
    tokens = [sampled_token(result)]
    while len(tokens) < 300 and not tokenizer.is_end_of_generation(tokens[-1]):
        position = len(prompt) + len(tokens) - 1
        result = engine.decode(
            StepRequest(key, position, token_ids=(tokens[-1],), expected_past_len=position, sampling=GREEDY)
        )
        tokens.append(sampled_token(result))
    engine.close()

    def text(count: int) -> str:
        stream = tokenizer.detokenizer()
        kept = [t for t in tokens[:count] if not tokenizer.is_end_of_generation(t)]
        return "".join(stream.feed(t) for t in kept) + stream.flush()

    return {count: text(count) for count in (24, 300)}


def node_ids(cluster: QuicCluster) -> dict[str, bytes]:
    return {name: cluster.named(name).node_id() for name in SPLITS}


async def route_ready(api: str, cluster: QuicCluster) -> None:
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


async def stream_chat(
    api: str, body: dict, *, on_chunk: Callable[[int], object] | None = None
) -> tuple[str, dict]:
    """Streamed chat text and the usage chunk."""
    pieces, usage = [], {}
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            data = line.strip().removeprefix(b"data: ")
            if not data or data == b"[DONE]":
                continue
            event = json.loads(data)
            assert "error" not in event, f"the answer ended in an error: {event['error']}"
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                if on_chunk is not None:
                    on_chunk(len(pieces))
    return "".join(pieces), usage


async def generations(api: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{api}/meshnode/generations") as r:
        return await r.json()


__all__ = [
    "API_NODES",
    "MESSAGES",
    "MODEL",
    "SPLITS",
    "cluster_node_args",
    "generations",
    "node_ids",
    "route_ready",
    "stream_chat",
    "unsplit_chat_answers",
]
