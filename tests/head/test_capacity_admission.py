"""A full mesh answers 429: the driver over real shard servers (fake engines) behind the real API.

The driver's node serves ``[0, 2)`` locally; two replicas serve ``[2, 4)``, each
holding one session. Sessions held open by generations that have produced a
token fill the mesh; the next request must be refused with OpenAI's rate-limit
error and ``Retry-After``, and requests accepted meanwhile must complete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from helpers.loopback_routes import DRIVER_INDEX, LoopbackRoutes
from helpers.polling import eventually
from helpers.small_tokenizer import SmallTokenizer

from engines.interface import GREEDY
from meshnode.api.openai_api import start_api_server
from meshnode.head.backend import MeshBusy
from meshnode.head.driver import DriverConfig, GenerationDriver, GenerationStream
from meshnode.head.route_backend import LocalModel, RouteBackend

pytestmark = pytest.mark.timeout(30)

REPLICA, SPARE = 2, 4
FAST = DriverConfig(stall_probe_s=5.0, probe_timeout_s=0.5, control_timeout_s=1.0, open_timeout_s=2.0)
PROMPT = [5, 3, 8, 1]
BUSY_ERROR = {
    "message": "every route's shards are at capacity (2 refused a new session); retry shortly",
    "type": "rate_limit_exceeded",
    "param": None,
    "code": "mesh_at_capacity",
}


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    routes = LoopbackRoutes()
    await routes.add_shard(DRIVER_INDEX, 0, 2, max_sessions=4)
    await routes.add_shard(REPLICA, 2, 4, max_sessions=1)
    await routes.add_shard(SPARE, 2, 4, max_sessions=1)
    yield routes
    await routes.aclose()


class Api:
    def __init__(self, driver: GenerationDriver, http: aiohttp.ClientSession, url: str) -> None:
        self.driver = driver
        self.http = http
        self.url = url

    async def complete(self, *, stream: bool = False) -> tuple[int, dict[str, str], object]:
        body = {"model": "fake", "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": stream}
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            payload = await (response.text() if stream else response.json())
            return response.status, dict(response.headers), payload


@pytest.fixture
async def api(routes: LoopbackRoutes) -> AsyncIterator[Api]:
    yield await _api(routes, FAST)


_cleanups: list = []


async def _api(routes: LoopbackRoutes, options: DriverConfig) -> Api:
    driver = GenerationDriver(routes, options)
    backend = RouteBackend(driver, [LocalModel("fake", routes.model.model_artifact_digest, SmallTokenizer())])
    runner, port = await start_api_server(backend)
    http = aiohttp.ClientSession()

    async def close() -> None:
        await http.close()
        await runner.cleanup()
        await driver.aclose()

    _cleanups.append(close)
    return Api(driver, http, f"http://127.0.0.1:{port}")


@pytest.fixture(autouse=True)
async def _close_apis() -> AsyncIterator[None]:
    yield
    while _cleanups:
        await _cleanups.pop()()


async def started(driver: GenerationDriver, count: int) -> list[GenerationStream]:
    """``count`` generations that each produced a token and hold their sessions."""
    streams = []
    for _ in range(count):
        stream = driver.generate(routes_model(driver), PROMPT, GREEDY, 8)
        await anext(stream)
        streams.append(stream)
    return streams


def routes_model(driver: GenerationDriver):
    (identity,) = {c.model for c in driver.env.candidates()}
    return identity


def sessions(routes: LoopbackRoutes, index: int) -> int:
    return routes.shards[index].server.load().active_sessions


async def test_sessions_spread_over_the_replicas_and_a_full_mesh_answers_429(routes, api):
    held = await started(api.driver, 2)
    # Gossip still says both replicas are idle; the head's own count sent the second elsewhere.
    assert (sessions(routes, REPLICA), sessions(routes, SPARE)) == (1, 1)

    for stream in (False, True):
        status, headers, body = await api.complete(stream=stream)
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert (json.loads(body) if stream else body) == {"error": BUSY_ERROR}
    assert api.driver.stats.busy == 2
    assert api.driver.stats.capacity_refusals == 4  # each request asked both replicas

    # The accepted generations were not disturbed, and room is room again once one ends.
    for stream in held:
        assert len([token async for token in stream]) == 7
    await eventually(lambda: sessions(routes, REPLICA) + sessions(routes, SPARE) == 0)
    status, _, body = await api.complete()
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def test_a_replica_full_of_another_heads_sessions_refuses_and_the_next_one_serves(routes, api):
    other_head = await _api(routes, FAST)
    held = await started(other_head.driver, 1)
    # This head's gossip and ledger say nothing of it: it asks the same replica first, is refused, moves on.
    status, _, body = await api.complete()
    assert status == 200 and len(body["choices"][0]["text"]) == 4
    assert api.driver.stats.capacity_refusals == 1
    for stream in held:
        await stream.aclose()


async def test_a_first_hop_at_capacity_with_no_replica_is_a_429(routes):
    worker = routes.shards[DRIVER_INDEX].server.worker
    worker.admission = dataclasses.replace(worker.admission, max_sessions=1)
    first, second = await _api(routes, FAST), await _api(routes, FAST)
    held = await started(first.driver, 1)
    status, headers, body = await second.complete()
    assert (status, headers["Retry-After"], body["error"]["code"]) == (429, "1", "mesh_at_capacity")
    assert body["error"]["message"].startswith("every route's shards are at capacity (1 refused")
    for stream in held:
        await stream.aclose()


async def test_the_heads_own_limit_of_concurrent_generations_is_a_429(routes):
    api = await _api(routes, DriverConfig(max_generations=1, busy_retry_after_s=3))
    held = await started(api.driver, 1)
    status, headers, body = await api.complete()
    assert (status, headers["Retry-After"]) == (429, "3")
    assert body == {
        "error": {
            "message": "this node already runs 1 generations, its limit",
            "type": "rate_limit_exceeded",
            "param": None,
            "code": "mesh_at_capacity",
        }
    }
    for stream in held:
        await stream.aclose()
    status, _, _ = await api.complete()
    assert status == 200


async def test_the_driver_refuses_a_generation_every_replica_is_too_full_for_with_mesh_busy(routes, api):
    held = await started(api.driver, 2)
    with pytest.raises(MeshBusy):
        await anext(api.driver.generate(routes_model(api.driver), PROMPT, GREEDY, 4))
    for stream in held:
        await stream.aclose()
