"""/health as readiness over the real route backend: a complete route for a model and not draining."""

from types import SimpleNamespace

import aiohttp
import pytest
from scripted_backend import CharTokenizer

from meshnode.api.openai_api import start_api_server
from meshnode.head.planner import ModelIdentity, ShardCandidate
from meshnode.head.route_backend import LocalModel, RouteBackend

MODEL = ModelIdentity("sha256:model", "sha256:recipe", total_layers=4)


def shard(node: int, start: int, end: int, *, context: int = 0) -> ShardCandidate:
    return ShardCandidate(bytes([node]) * 32, "tiny", MODEL, start, end, max_context_tokens=context)


def backend(*candidates: ShardCandidate) -> RouteBackend:
    # The backend reads only the driver's view of the mesh here.
    driver = SimpleNamespace(env=SimpleNamespace(candidates=lambda: list(candidates)))
    return RouteBackend(driver, [LocalModel("tiny", MODEL.model_artifact_digest, CharTokenizer())])  # type: ignore[arg-type]  # a stand-in driver


def test_not_ready_without_a_complete_route_or_while_draining():
    assert backend().not_ready_reason() == "no node of the mesh serves tiny yet"
    partial = backend(shard(1, 0, 2)).not_ready_reason()
    assert partial is not None and partial.startswith("tiny: ")
    complete = backend(shard(1, 0, 2), shard(2, 2, 4))
    assert complete.not_ready_reason() is None
    complete.draining = True
    assert complete.not_ready_reason() == "draining: this node is shutting down"


def test_the_context_is_the_smallest_of_the_route_hops():
    assert backend(shard(1, 0, 2, context=4096), shard(2, 2, 4, context=1024)).context_tokens("tiny") == 1024
    assert backend(shard(1, 0, 4)).context_tokens("tiny") is None  # a node that does not say
    assert backend(shard(1, 0, 2, context=512)).context_tokens("tiny") is None  # no complete route


@pytest.mark.parametrize(
    ("candidates", "draining", "status"),
    [((), False, 503), ((shard(1, 0, 4),), False, 200), ((shard(1, 0, 4),), True, 503)],
)
async def test_health_answers_readiness_and_livez_liveness(candidates, draining, status):
    route_backend = backend(*candidates)
    route_backend.draining = draining
    runner, port = await start_api_server(route_backend, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                body = await response.json()
                assert response.status == status
                assert body["status"] == ("ok" if status == 200 else "unavailable")
                assert ("reason" in body) == (status == 503)
            async with session.get(f"http://127.0.0.1:{port}/livez") as response:
                assert response.status == 200
    finally:
        await runner.cleanup()
