"""Acceptance (issue 15): several people at once through a chain of real ``meshnode`` processes.

Gemma 3 270M (the built-in default model, real llama.cpp) split as the issue found it:
A serves [0, 4) and the API, B and B2 both serve [4, 13) (B2 is the spare), C serves
[13, 18). Each shard batches the ready steps of all its sessions into one engine call,
so a session's text must not depend on who else is generating: every concurrent
stream must be exactly the greedy text the same prompt gets alone through the same
mesh, also when one of them hangs up mid-batch and when the middle node dies mid-batch.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from helpers.node_processes import QuicCluster, api_node_args

from engines.default_model import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPLITS = {"A": (0, 4), "B": (4, 13), "B2": (4, 13), "C": (13, 18)}
PROMPTS = [
    "The sea was",
    "Once upon a time, a small robot",
    "The capital of France is",
    "def fibonacci(n):",
]
# Two more than a shard holds, for the admission test.
EXTRA_PROMPTS = ["In the beginning", "My favourite colour is"]
TOKENS = 24
# Sessions each shard holds: every test below stays within it.
MAX_SESSIONS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuicCluster]:
    args = api_node_args(SPLITS, ("A",), "--probe-timeout", "1", "--max-sessions", str(MAX_SESSIONS))
    cluster = QuicCluster(tmp_path_factory.mktemp("gemma-mesh"), default_model_path(progress=False), args)
    with cluster.running(SPLITS):
        yield cluster


@pytest.fixture(scope="module")
def api(cluster: QuicCluster) -> str:
    return cluster.named("A").api_url()


async def served_model(api: str) -> str:
    """The model id once A's API lists it (a complete route exists)."""
    async with asyncio.timeout(60), aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{api}/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            if listed:
                return listed[0]
            await asyncio.sleep(0.2)


async def stream_text(
    api: str,
    prompt: str,
    *,
    hang_up_after: int | None = None,
    on_piece: Callable[[int], object] | None = None,
) -> str:
    """The streamed greedy completion of ``prompt`` (or what came before hanging up);
    ``on_piece`` hears the count of text pieces so far."""
    body = {"model": await served_model(api), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "stream": True}  # fmt: skip
    pieces: list[str] = []
    async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            data = line.strip().removeprefix(b"data: ")
            if not data or data == b"[DONE]":
                continue
            for choice in json.loads(data)["choices"]:
                pieces.append(choice.get("text") or "")
            if on_piece is not None:
                on_piece(len(pieces))
            if hang_up_after is not None and len(pieces) >= hang_up_after:
                r.close()
                break
    return "".join(pieces)


@pytest.fixture(scope="module")
def solo(api: str) -> dict[str, str]:
    """Each prompt's text alone through the same mesh, one request after another."""

    async def run() -> dict[str, str]:
        return {prompt: await stream_text(api, prompt) for prompt in [*PROMPTS, *EXTRA_PROMPTS]}

    return asyncio.run(run())


async def until_idle(api: str) -> None:
    """Until A holds no session: each test starts with all of A's sessions free."""
    async with asyncio.timeout(30), aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{api}/metrics") as r:
                text = await r.text()
            active = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("meshnode_sessions_active")]  # fmt: skip
            if active and sum(active) == 0:
                return
            await asyncio.sleep(0.1)


async def batch_counts(api: str) -> tuple[float, float]:
    """A's engine batches so far, and those of them that ran one unit only (its /metrics)."""
    async with aiohttp.ClientSession() as session, session.get(f"{api}/metrics") as r:
        samples = dict(
            line.rsplit(" ", 1) for line in (await r.text()).splitlines() if not line.startswith("#")
        )
    return float(samples["meshnode_batches_total"]), float(samples['meshnode_batch_size_bucket{le="1.0"}'])


async def test_concurrent_streams_each_get_their_solo_greedy_text(api, solo):
    await until_idle(api)
    batches, alone = await batch_counts(api)
    texts = await asyncio.gather(*(stream_text(api, prompt) for prompt in PROMPTS))
    assert dict(zip(PROMPTS, texts, strict=True)) == {prompt: solo[prompt] for prompt in PROMPTS}
    assert all(len(text) > 0 for text in texts)
    # And they were computed together: some of A's batches carried several sessions' steps.
    batches_after, alone_after = await batch_counts(api)
    assert batches_after - batches > alone_after - alone


async def test_a_stream_hung_up_inside_a_batch_leaves_the_others_untouched(api, solo):
    await until_idle(api)
    kept = PROMPTS[1:]
    hung_up, *texts = await asyncio.gather(
        stream_text(api, PROMPTS[0], hang_up_after=3), *(stream_text(api, prompt) for prompt in kept)
    )
    assert solo[PROMPTS[0]].startswith(hung_up)
    assert dict(zip(kept, texts, strict=True)) == {prompt: solo[prompt] for prompt in kept}


async def test_requests_beyond_capacity_get_429_and_every_accepted_one_completes(api, solo):
    await until_idle(api)

    async def attempt(prompt: str) -> tuple[int, str | None, dict | str]:
        body = {"model": await served_model(api), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
        async with aiohttp.ClientSession() as session, session.post(f"{api}/v1/completions", json=body) as r:
            answer = await r.json()
            return r.status, r.headers.get("Retry-After"), answer

    prompts = [*PROMPTS, *EXTRA_PROMPTS]
    outcomes = dict(zip(prompts, await asyncio.gather(*(attempt(p) for p in prompts)), strict=True))
    refused = {p: o for p, o in outcomes.items() if o[0] == 429}
    accepted = {p: o for p, o in outcomes.items() if o[0] == 200}
    # A holds MAX_SESSIONS sessions and has no replica: the rest are told to come back.
    assert len(accepted) == MAX_SESSIONS and len(refused) == len(prompts) - MAX_SESSIONS
    for _, retry_after, answer in refused.values():
        assert retry_after is not None and int(retry_after) >= 1
        assert isinstance(answer, dict)
        assert answer["error"]["type"] == "rate_limit_exceeded"
        assert answer["error"]["code"] == "mesh_at_capacity"
    for prompt, (_, _, answer) in accepted.items():
        assert isinstance(answer, dict)
        assert answer["choices"][0]["text"] == solo[prompt]


def middle_sessions(cluster: QuicCluster) -> dict[str, int]:
    """The sessions B and B2 announce holding, as A sees them in gossip."""
    status = cluster.named("A").status()
    assert status is not None
    ids = {cluster.named(name).node_id().hex(): name for name in ("B", "B2")}
    return {ids[p["id"]]: p["load"]["active_sessions"] for p in status["peers"] if p["id"] in ids}


async def test_the_middle_node_killed_mid_batch_fails_every_session_over_to_identical_text(
    api, cluster, solo
):
    # Runs last: it leaves the mesh without B or B2.
    await until_idle(api)
    started = [asyncio.Event() for _ in PROMPTS]

    def seen(index: int) -> Callable[[int], object]:
        return lambda count: count >= 4 and started[index].set()

    streams = asyncio.gather(*(stream_text(api, p, on_piece=seen(i)) for i, p in enumerate(PROMPTS)))
    async with asyncio.timeout(60):
        for event in started:
            await event.wait()
        while not any((count := middle_sessions(cluster)).values()):
            await asyncio.sleep(0.05)
    # The busier middle node dies with sessions in its batches (heartbeats carry the load).
    victim = max(count, key=lambda name: count[name])
    cluster.named(victim).process.send_signal(signal.SIGKILL)
    texts = await streams
    assert dict(zip(PROMPTS, texts, strict=True)) == {prompt: solo[prompt] for prompt in PROMPTS}
