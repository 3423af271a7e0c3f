"""A request's ``deadline_s`` against the route's expected time: the real API over the driver and
real shard servers (fake engines), the speeds the shards announce set by the test.

The route is this node's ``[0, 2)`` then a peer's ``[2, 4)``, announcing 20 and 30 ms a decode
step and 1 ms a prefilled token each: with the planner's 2 ms a hop, 54 ms a token and 2 ms a
prompt token. The prompt "hello" is five tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from helpers.loopback_routes import DRIVER_INDEX, LoopbackRoutes
from helpers.small_tokenizer import SmallTokenizer

from meshnode.api.openai_api import start_api_server
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.head.route_backend import LocalModel, RouteBackend
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(30)

PEER = 2
FAST = DriverConfig(stall_probe_s=5.0, probe_timeout_s=0.5, control_timeout_s=1.0, open_timeout_s=2.0)


def announce_speed(routes: LoopbackRoutes, index: int, decode_us: int, prefill_us: int) -> None:
    routes.shards[index].announcement.serving.speed.CopyFrom(
        mesh.StageSpeed(
            decode_us_per_token=decode_us,
            prefill_us_per_token=prefill_us,
            samples=40,
            source=mesh.STAGE_SPEED_SOURCE_MEASURED,
        )
    )


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    routes = LoopbackRoutes()
    await routes.add_shard(DRIVER_INDEX, 0, 2)
    await routes.add_shard(PEER, 2, 4)
    yield routes
    await routes.aclose()


@pytest.fixture
async def api(routes: LoopbackRoutes) -> AsyncIterator[tuple[RouteBackend, str]]:
    driver = GenerationDriver(routes, FAST)
    backend = RouteBackend(driver, [LocalModel("fake", routes.model.model_artifact_digest, SmallTokenizer())])
    runner, port = await start_api_server(backend)
    yield backend, f"http://127.0.0.1:{port}"
    await runner.cleanup()
    await driver.aclose()


async def complete(url: str, **fields: object) -> tuple[int, dict]:
    body = {"model": "fake", "prompt": "hello", "temperature": 0, **fields}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.json()


def engine_calls(routes: LoopbackRoutes) -> int:
    return sum(len(shard.engine.calls) for shard in routes.shards.values())


async def test_a_deadline_the_route_cannot_meet_is_refused_before_any_shard_computes(routes, api):
    announce_speed(routes, DRIVER_INDEX, 20_000, 1_000)
    announce_speed(routes, PEER, 30_000, 1_000)
    backend, url = api
    expected = backend.route_time("fake")
    assert expected is not None and expected.decode_ms_per_token == pytest.approx(54.0)

    # 100 tokens take 5.41 s; within 1 s, (1000 - 5 * 2) / 54 = 18 tokens fit.
    status, body = await complete(url, max_tokens=100, deadline_s=1)
    assert status == 400
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "deadline_unreachable",
        "deadline_s",
    )
    assert "expected to take 5.5 s" in error["message"]
    assert "max_tokens 100 at 54.0 ms each" in error["message"]
    assert "ask for at most 18 tokens" in error["message"]
    assert engine_calls(routes) == 0

    # What fits is answered in full.
    status, body = await complete(url, max_tokens=18, deadline_s=1)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 18
    assert body["choices"][0]["finish_reason"] == "length"


async def test_a_default_max_tokens_is_cut_to_what_the_deadline_allows(routes, api):
    announce_speed(routes, DRIVER_INDEX, 20_000, 1_000)
    announce_speed(routes, PEER, 30_000, 1_000)
    _, url = api
    # /v1/completions' default is 16 tokens (869 ms); 0.5 s holds (500 - 10) / 54 = 9.
    status, body = await complete(url, deadline_s=0.5)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 9
    # Without a deadline the default stands.
    status, body = await complete(url)
    assert body["usage"]["completion_tokens"] == 16


async def test_not_even_one_token_within_the_deadline_is_refused_whatever_max_tokens(routes, api):
    announce_speed(routes, DRIVER_INDEX, 20_000, 1_000)
    announce_speed(routes, PEER, 30_000, 1_000)
    _, url = api
    status, body = await complete(url, deadline_s=0.05)
    assert status == 400
    assert body["error"]["code"] == "deadline_unreachable"
    assert "allow more time" in body["error"]["message"]


async def test_a_route_with_a_hop_that_announces_no_speed_is_not_judged(routes, api):
    announce_speed(routes, DRIVER_INDEX, 20_000, 1_000)
    backend, url = api
    expected = backend.route_time("fake")
    assert expected is not None and expected.decode_ms_per_token is None
    status, body = await complete(url, max_tokens=20, deadline_s=0.05)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("value", [0, -1, "10", True, 86_401])
async def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused(api, value):
    _, url = api
    status, body = await complete(url, max_tokens=4, deadline_s=value)
    assert status == 400
    assert body["error"]["param"] == "deadline_s"
    assert body["error"]["code"] is None
