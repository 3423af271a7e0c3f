"""``--model-name`` (a model served under an alias) and ``/v1/models``' layer coverage.

The coverage checks run the API over the in-process loopback mesh (fake engines); the alias
is checked end to end too: ``meshnode serve --model-name`` with the tiny GGUF, asked over HTTP.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from helpers.loopback_routes import DRIVER_INDEX, LoopbackRoutes
from helpers.serve_process import serving_process

from engines.interface import GREEDY
from engines.tiny_model import ensure_tiny_model
from meshnode.api.openai_api import start_api_server
from meshnode.app.api_options import parse_model_name
from meshnode.head.coverage import CoverageSpan, layer_coverage
from meshnode.head.driver import GenerationDriver
from meshnode.head.planner import ModelIdentity, ShardCandidate
from meshnode.head.route_backend import LocalModel, RouteBackend

ALIAS = "house-model"
MODEL = ModelIdentity("artifact", "recipe", 8)


def shard(node: int, start: int, end: int, model: ModelIdentity = MODEL) -> ShardCandidate:
    return ShardCandidate(bytes([node]) * 32, "m", model, start, end)


def spans(*triples: tuple[int, int, int]) -> tuple[CoverageSpan, ...]:
    return tuple(CoverageSpan(*triple) for triple in triples)


def test_coverage_counts_the_shards_over_each_span_and_merges_equal_neighbours() -> None:
    # [0, 4) twice, [4, 8) once, split differently on the two copies of the first half.
    shards = [shard(1, 0, 4), shard(2, 0, 2), shard(3, 2, 4), shard(4, 4, 8)]
    assert layer_coverage(shards, MODEL).spans == spans((0, 4, 2), (4, 8, 1))
    assert layer_coverage(shards, MODEL).total_layers == 8


def test_coverage_shows_a_gap_and_ignores_other_models() -> None:
    other = ModelIdentity("other", "recipe", 8)
    shards = [shard(1, 0, 3), shard(2, 5, 8), shard(3, 0, 8, other)]
    assert layer_coverage(shards, MODEL).spans == spans((0, 3, 1), (3, 5, 0), (5, 8, 1))
    assert layer_coverage([], MODEL).spans == spans((0, 8, 0))


@pytest.mark.parametrize("bad", ["", "two words", "x" * 257, "tab\there"])
def test_a_model_name_is_one_printable_word_a_peer_accepts(bad: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_model_name(bad)


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    routes = LoopbackRoutes()
    await routes.add_shard(DRIVER_INDEX, 0, 2)
    await routes.add_shard(2, 2, 4)
    await routes.add_shard(3, 2, 4)
    yield routes
    await routes.aclose()


@pytest.fixture
async def api(routes: LoopbackRoutes) -> AsyncIterator[str]:
    driver = GenerationDriver(routes)
    # /v1/models and generate() by name need no tokenizer; a request's prompt would.
    local = LocalModel(ALIAS, routes.model.model_artifact_digest, tokenizer=None)  # type: ignore[arg-type]  # see above
    backend = RouteBackend(driver, [local])
    runner, port = await start_api_server(backend, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await driver.aclose()


async def models(api: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(f"{api}/v1/models") as response:
        assert response.status == 200
        return (await response.json())["data"]


async def test_v1_models_shows_each_models_layer_coverage_and_replicas(api, routes) -> None:
    (model,) = await models(api)
    assert model["id"] == ALIAS and model["object"] == "model"
    total = routes.model.total_layers
    assert total == 4
    # This node's shard covers [0, 2); two peers each serve [2, 4).
    assert model["meshnode"] == {"layers": total, "coverage": [[0, 2, 1], [2, 4, 2]]}


async def test_coverage_follows_the_mesh_as_replicas_go(api, routes) -> None:
    routes.hidden.add(routes.shards[3].node_id)
    (model,) = await models(api)
    assert model["meshnode"]["coverage"] == [[0, 4, 1]]


async def test_the_alias_is_what_the_backend_generates_for(routes) -> None:
    driver = GenerationDriver(routes)
    local = LocalModel(ALIAS, routes.model.model_artifact_digest, tokenizer=None)  # type: ignore[arg-type]  # see above
    backend = RouteBackend(driver, [local])
    try:
        assert backend.model_names() == [ALIAS]
        tokens = [t async for t in backend.generate(ALIAS, [5, 3, 8], GREEDY, 3)]
        assert len(tokens) == 3
    finally:
        await driver.aclose()


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def aliased_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    model = ensure_tiny_model()
    log = tmp_path_factory.mktemp("alias") / "serve.log"
    with serving_process(log, model, "--model-name", ALIAS, ctx=256) as (url, _):
        yield url, model


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_serve_with_model_name_lists_and_answers_the_alias_only(aliased_serve) -> None:
    url, model = aliased_serve
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        (listed,) = json.loads(response.read())["data"]
    assert listed["id"] == ALIAS
    assert listed["meshnode"]["coverage"] == [[0, listed["meshnode"]["layers"], 1]]
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    status, answer = post(f"{url}/v1/completions", {**body, "model": ALIAS})
    assert status == 200 and answer["model"] == ALIAS
    # The file's own name is no longer one the node answers to.
    status, refusal = post(f"{url}/v1/completions", {**body, "model": model.stem})
    assert status == 404 and ALIAS in refusal["error"]["message"]
