"""A node's ``/metrics`` through prometheus_client: counters that scrapes do not disturb, token
latency histograms fed by the driver, and a registry per node.

The node here is the driver's end of the in-process loopback mesh (fake engines): the head's
shard serves ``[0, 2)``, a peer ``[2, 4)``. Expositions are parsed with prometheus_client's own
text parser, so the checks hold for what a Prometheus server reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
from helpers.loopback_routes import DRIVER_INDEX, LoopbackRoutes, Shard
from helpers.recording_engine import RecordingEngine
from prometheus_client.parser import text_string_to_metric_families

from engines.interface import (
    GREEDY,
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    LoadRequest,
    SessionKey,
    StepRequest,
)
from engines.tiny_model import ensure_tiny_model
from meshnode.app.head_service import HeadConfig, HeadService
from meshnode.head.driver import GenerationDriver
from meshnode.metrics import (
    CONTENT_TYPE,
    INTER_TOKEN_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    MetricSources,
    NodeMetrics,
)
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 3, 8, 1, 9, 2, 7]
GENERATED = 6
TAIL = 3
# What the generation below changes: each must move between the scrapes before and after it.
COUNTERS_OF_A_GENERATION = {
    "meshnode_completion_tokens_total": GENERATED,
    "meshnode_tokens_generated_total": GENERATED,
    "meshnode_prompt_tokens_total": len(PROMPT),
    "meshnode_time_to_first_token_seconds_count": 1,
    "meshnode_inter_token_latency_seconds_count": GENERATED - 1,
}


def parse(exposition: bytes) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    """{sample name: {labels: value}} of an exposition."""
    samples: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: dict[str, dict[frozenset[tuple[str, str]], float]], name: str, **labels: str) -> float:
    return samples[name][frozenset(labels.items())]


def counters(samples: dict[str, dict[frozenset[tuple[str, str]], float]]) -> dict[str, float]:
    """The counter and histogram samples (a gauge may move on its own between scrapes)."""
    return {
        f"{name}{sorted(labels)}": v
        for name, series in samples.items()
        if name.endswith(("_total", "_bucket", "_count", "_sum"))
        for labels, v in series.items()
    }


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    routes = LoopbackRoutes()
    await routes.add_shard(DRIVER_INDEX, 0, 2)
    await routes.add_shard(TAIL, 2, 4)
    yield routes
    await routes.aclose()


def head_metrics(routes: LoopbackRoutes) -> tuple[GenerationDriver, NodeMetrics]:
    """A driver and its node's metrics, wired as meshnode.app.head_service wires them."""
    driver = GenerationDriver(routes)
    server = routes.shards[DRIVER_INDEX].server
    metrics = NodeMetrics(MetricSources(server=server, driver=driver))
    driver.token_observers.append(metrics.observe_token)
    return driver, metrics


async def generate(driver: GenerationDriver, routes: LoopbackRoutes) -> list[int]:
    return [token async for token in driver.generate(routes.model, PROMPT, GREEDY, GENERATED)]


async def test_the_heads_metrics_endpoint_serves_the_text_format_with_the_drivers_latencies(routes) -> None:
    # The head as meshnode.app.head_service starts it (the tiny GGUF only lends its tokenizer).
    served = mesh.ServedShard(model_name="fake")
    served.fingerprint.model_artifact_digest = routes.model.model_artifact_digest
    head = await HeadService.start(
        routes,
        model_path=ensure_tiny_model(),
        served=served,
        options=HeadConfig(api_host="127.0.0.1", api_port=0),
        metrics=MetricSources(server=routes.shards[DRIVER_INDEX].server),
    )
    try:
        await generate(head.driver, routes)
        async with aiohttp.ClientSession() as session, session.get(f"{head.url}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == CONTENT_TYPE
            assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
            samples = parse(await response.read())
    finally:
        await head.aclose()
    assert value(samples, "meshnode_time_to_first_token_seconds_count") == 1
    assert value(samples, "meshnode_inter_token_latency_seconds_count") == GENERATED - 1


async def test_a_generation_moves_the_counters_and_fills_the_latency_histograms(routes) -> None:
    driver, metrics = head_metrics(routes)
    before = parse(await metrics.exposition())
    assert len(await generate(driver, routes)) == GENERATED
    after = parse(await metrics.exposition())
    for name, moved in COUNTERS_OF_A_GENERATION.items():
        assert value(after, name) - value(before, name) == moved, name
    assert value(after, "meshnode_generations_total", outcome="completed") == 1
    # Its route's hops announce no machines of their own, so --pipeline auto keeps every
    # session in one batch a stage (head.pipeline), and the metric says so.
    assert (
        value(after, "meshnode_routes_opened_total", pipeline="one_batch")
        - value(before, "meshnode_routes_opened_total", pipeline="one_batch")
        == 1
    )
    assert value(after, "meshnode_routes_opened_total", pipeline="cohorts") == 0
    assert value(after, "meshnode_route_pipeline_cohorts") == 0
    # The head's shard ran the prompt's prefill and a decode step for each later token at least.
    assert value(after, "meshnode_engine_steps_total", kind="prefill") >= 1
    assert value(after, "meshnode_engine_steps_total", kind="decode") >= GENERATED - 1
    assert value(after, "meshnode_engine_sessions_opened_total") >= 1
    assert 0 <= value(after, "meshnode_kv_cache_usage_ratio") <= 1
    assert value(after, "meshnode_kv_cache_usage_ratio") == value(after, "meshnode_kv_pressure")
    # Every configured bucket is exposed, cumulative, ending in +Inf with the count.
    for histogram, bounds in (
        ("meshnode_time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS),
        ("meshnode_inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS),
    ):
        buckets = after[f"{histogram}_bucket"]
        assert {float(dict(labels)["le"]) for labels in buckets} == {*bounds, float("inf")}
        counts = [count for _, count in sorted((float(dict(k)["le"]), v) for k, v in buckets.items())]
        assert counts == sorted(counts) and counts[-1] == value(after, f"{histogram}_count")


async def test_a_second_scraper_changes_nothing_another_reads(routes) -> None:
    driver, metrics = head_metrics(routes)
    await generate(driver, routes)
    first, second = parse(await metrics.exposition()), parse(await metrics.exposition())
    assert counters(first) == counters(second)
    assert value(second, "meshnode_completion_tokens_total") == GENERATED
    # What replaced the rate computed between scrapes: the scraper takes rate() of the counter.
    assert "meshnode_tokens_per_second" not in second


async def test_the_old_mixed_engine_events_family_is_split_by_what_it_counts(routes) -> None:
    driver, metrics = head_metrics(routes)
    await generate(driver, routes)
    samples = parse(await metrics.exposition())
    assert "meshnode_engine_events_total" not in samples
    assert {dict(labels)["reason"] for labels in samples["meshnode_engine_sessions_ended_total"]} == {
        "released",
        "evicted",
        "expired",
        "cancelled",
    }
    assert value(samples, "meshnode_engine_tokens_processed_total") >= len(PROMPT) + GENERATED - 1


async def test_build_info_names_this_version_and_the_llama_cpp_binding(routes) -> None:
    from importlib.metadata import version

    from meshnode import __version__

    _, metrics = head_metrics(routes)
    samples = parse(await metrics.exposition())
    ((labels, one),) = samples["meshnode_build_info"].items()
    assert one == 1
    assert dict(labels) == {"version": __version__, "llama_cpp": version("llama-cpp-python")}


async def test_each_node_counts_in_its_own_registry(routes) -> None:
    driver, metrics = head_metrics(routes)
    _, other = head_metrics(routes)
    await generate(driver, routes)
    assert value(parse(await metrics.exposition()), "meshnode_time_to_first_token_seconds_count") == 1
    assert value(parse(await other.exposition()), "meshnode_time_to_first_token_seconds_count") == 0


class PrefixKeepingEngine(RecordingEngine):
    """The recording fake engine with the prefix cache on (two kept prefixes at most)."""

    def load(self, request: LoadRequest) -> EngineCapabilities:
        return super().load(replace(request, prefix_cache_entries=2))


async def test_the_prefix_caches_counters_of_the_shard_and_the_head() -> None:
    routes = LoopbackRoutes()
    try:
        await check_prefix_counters(routes, await routes.add_shard(DRIVER_INDEX, 0, 2, PrefixKeepingEngine))
    finally:
        await routes.aclose()


async def check_prefix_counters(routes: LoopbackRoutes, shard: Shard) -> None:
    driver, metrics = head_metrics(routes)
    before = parse(await metrics.exposition())
    assert value(before, "meshnode_prefix_cache_hits_total") == 0
    assert value(before, "meshnode_prefix_cache_entries") == 0
    # The shard keeps a released session's two blocks, a later session opens from them, and
    # one asks for a prefix it never kept.
    engine = shard.engine
    first = SessionKey("first", 1)
    for block, digest in ((0, b"block-1"), (4, b"block-2")):
        engine.prefill(StepRequest(first, block, token_ids=(1, 2, 3, 4), block_digest=digest))
    assert engine.release(first)
    after_release = parse(await metrics.exposition())
    assert value(after_release, "meshnode_prefix_cache_kept_total") == 1
    assert value(after_release, "meshnode_prefix_cache_entries") == 1
    engine.prefill(StepRequest(SessionKey("second", 1), 8, token_ids=(9,), prefix_digest=b"block-2"))
    with pytest.raises(EngineError) as missed:
        engine.prefill(StepRequest(SessionKey("third", 1), 4, token_ids=(9,), prefix_digest=b"other"))
    assert missed.value.kind == EngineErrorKind.CACHE_MISS
    driver.stats.prefix_hits, driver.stats.prefix_misses = 3, 1
    driver.stats.prefix_cached_tokens, driver.stats.prefix_route_preferred = 96, 2
    samples = parse(await metrics.exposition())
    assert value(samples, "meshnode_prefix_cache_hits_total") == 1
    assert value(samples, "meshnode_prefix_cache_misses_total") == 1
    assert value(samples, "meshnode_prefix_cache_tokens_reused_total") == 8
    assert value(samples, "meshnode_prefix_cache_entries") == 0  # the second session took its slot
    assert value(samples, "meshnode_prefix_cache_evicted_total") == 0
    assert value(samples, "meshnode_head_prefix_cache_hits_total") == 3
    assert value(samples, "meshnode_head_prefix_cache_misses_total") == 1
    assert value(samples, "meshnode_prompt_tokens_cached_total") == 96
    assert value(samples, "meshnode_head_prefix_route_preferred_total") == 2
    # Named families only: none of them also appears among the engine's unnamed events.
    others = {dict(labels)["event"] for labels in samples.get("meshnode_engine_other_events_total", {})}
    assert not {event for event in others if event.startswith("prefix")}
