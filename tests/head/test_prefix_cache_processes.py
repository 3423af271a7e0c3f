"""Acceptance: a six-turn chat through three real ``meshnode`` processes gives the same text with
the prefix cache on and off, and from the second turn on the cache reuses prompt tokens.

Two three-node meshes on the tiny model over real QUIC, one started with ``--prefix-cache off``
and one with the cache on (the default); the client resends the whole conversation each turn,
its own answers included, as a chat client does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.node_processes import QuicCluster, api_node_args

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model

from .api_cluster import stream_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPLITS = {"A": (0, 2), "B": (2, 4), "C": (4, TINY_N_LAYERS)}
MODEL = "meshnode-tiny-llama-v1"
SYSTEM = "You are a patient assistant for a mesh of machines. " * 6
QUESTIONS = [
    "How do the machines share the layers of one model, and what crosses between them? " * 3,
    "What happens when one of the machines stops answering in the middle of an answer? " * 3,
    "Why does a conversation not start over from the first token on every turn? " * 3,
    "How is the next machine chosen when two of them serve the same layers? " * 3,
    "What does a machine behind a home router need to join the others? " * 3,
    "Summarise the conversation so far in a few sentences. " * 3,
]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


async def route_ready(api: str, mesh: QuicCluster) -> None:
    """Every node sees the two others, and the API lists the model."""
    async with asyncio.timeout(60), aiohttp.ClientSession() as session:
        while True:
            statuses = [p.status() for p in mesh.processes]
            seen = all(s is not None and len(s["peers"]) >= len(SPLITS) - 1 for s in statuses)
            async with session.get(f"{api}/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            if seen and listed == [MODEL]:
                return
            await asyncio.sleep(0.2)


def cluster(root: Path, model: Path, *extra: str) -> QuicCluster:
    # node_args come after the helper's own options: this --ctx wins over its default.
    args = api_node_args(SPLITS, ("A",), "--probe-timeout", "1", "--ctx", "2048", *extra)
    return QuicCluster(root, model, args)


async def six_turns(api: str) -> list[tuple[str, int, int]]:
    """Each turn's answer text, prompt tokens and cached tokens."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = await stream_chat(api, body)
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        turns.append((text, usage["prompt_tokens"], cached))
        messages.append({"role": "assistant", "content": text})
    return turns


@pytest.fixture(scope="module")
def without_cache(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[QuicCluster]:
    mesh = cluster(tmp_path_factory.mktemp("off"), tiny_model, "--prefix-cache", "off")
    with mesh.running(SPLITS):
        yield mesh


async def test_a_six_turn_chat_is_the_same_with_the_cache_and_reuses_from_the_second_turn(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, without_cache: QuicCluster
):
    api = without_cache.named("A").api_url()
    await route_ready(api, without_cache)
    plain = await six_turns(api)
    assert all(cached == 0 for _, _, cached in plain)
    assert plain[-1][1] > 600  # the history grew past several blocks of the grid

    with_cache = cluster(tmp_path_factory.mktemp("on"), tiny_model)
    with with_cache.running(SPLITS):
        api = with_cache.named("A").api_url()
        await route_ready(api, with_cache)
        cached = await six_turns(api)
        statuses = [p.status() for p in with_cache.processes]
    print(
        "\nturn: prompt tokens, cached with the cache on:", [(prompt, reused) for _, prompt, reused in cached]
    )
    assert [text for text, _, _ in cached] == [text for text, _, _ in plain]
    assert [prompt for _, prompt, _ in cached] == [prompt for _, prompt, _ in plain]
    assert cached[0][2] == 0
    for (_, prompt, reused), (_, previous_prompt, _) in zip(cached[1:], cached, strict=False):
        # At least the earlier turn's whole blocks before its answer, never the whole prompt.
        assert previous_prompt // 128 * 128 <= reused < prompt
    # The hops keep partial blocks (the CPU engine): some turn started after the whole previous
    # prompt, and some after the previous answer too, which the head kept once it ended.
    assert any(
        reused >= previous for (_, _, reused), (_, previous, _) in zip(cached[1:], cached, strict=False)
    )
    assert any(
        reused > previous for (_, _, reused), (_, previous, _) in zip(cached[1:], cached, strict=False)
    )
    assert all(status is not None for status in statuses)
