"""The generation driver over real shard servers on the in-process loopback mesh (fake engines).

The driver's own node serves ``[0, 2)`` through its local link; peers serve
``[2, 3)`` (twice, for failover) and ``[3, 4)``. Every test checks the tokens
against the whole model run on one engine, and the end state of every hop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from helpers.loopback_routes import (
    DRIVER_INDEX,
    FAST,
    MIDDLE,
    SPARE,
    TAIL,
    LoopbackRoutes,
    collect,
    reference,
    three_hop_routes,
)
from helpers.polling import eventually

from engines.fake import FaultKind, FaultRule
from engines.interface import GREEDY, METRIC_STEPS_CANCELLED, SamplingParams
from meshnode.head.backend import ContextLengthExceeded, GenerationFailed
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.head.numerics import system_fingerprint
from meshnode.head.recovery import RecoveryBudget

# Tests that count the engine steps of plain decoding: one token a step, no verify rounds.
PLAIN = DriverConfig(**{**FAST.__dict__, "speculation": False})

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 3, 8, 1, 9, 2, 7]


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes() as routes:
        yield routes


def no_sessions_anywhere(routes: LoopbackRoutes) -> bool:
    """On every hop still alive (a killed peer's state died with it)."""
    return all(
        s.server.load().active_sessions == 0
        for s in routes.shards.values()
        if not routes.mesh.down.get(s.node_id, False)
    )


async def test_three_hops_generate_the_whole_models_tokens_and_release_every_hop(routes):
    driver = GenerationDriver(routes, PLAIN)
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 12))
    assert tokens == reference(PROMPT, 12)
    # One prefill then eleven decode steps ran on every hop, the first through this node's local link.
    for shard in routes.shards.values():
        assert [call.n_tokens for call in shard.engine.calls] == [len(PROMPT)] + [1] * 11
    assert routes.me.streams_accepted == 0  # nothing came to this node over the mesh
    await eventually(lambda: no_sessions_anywhere(routes))
    assert driver.stats.completed == 1 and driver.stats.tokens == 12 and driver.stats.reroutes == 0


async def test_a_long_prompt_is_prefilled_in_pipelined_chunks():
    routes = LoopbackRoutes()
    try:
        head = await routes.add_shard(DRIVER_INDEX, 0, 2, max_context=1024)
        await routes.add_shard(MIDDLE, 2, 3, max_context=1024)
        await routes.add_shard(TAIL, 3, 4, max_context=1024)
        # Three chunks on the prefill grid (meshnode.head.prefix_index): two blocks of 128, the rest.
        prompt = [(7 * i) % 30 + 1 for i in range(300)]
        head.engine.step_delay_s = 0.1
        driver = GenerationDriver(routes, FAST)
        stream = driver.generate(routes.model, prompt, GREEDY, 3)
        first = asyncio.ensure_future(anext(stream))
        # The second chunk is at the first hop before the first chunk's answer came back.
        await eventually(
            lambda: head.server.load().queued_units >= 1 and head.server.load().running_units == 1
        )
        head.engine.step_delay_s = 0.0
        tokens = [await first, *[t async for t in stream]]
        assert tokens == reference(prompt, 3)
        assert [c.n_tokens for c in head.engine.calls][:3] == [128, 128, 44]
    finally:
        await routes.aclose()


async def test_seeded_sampling_draws_the_same_tokens_as_the_whole_model(routes):
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    driver = GenerationDriver(routes, FAST)
    tokens = await collect(driver.generate(routes.model, PROMPT, sampling, 15))
    assert tokens == reference(PROMPT, 15, sampling)
    assert tokens != reference(PROMPT, 15)  # it really sampled


async def test_a_killed_middle_hop_fails_over_to_a_spare_with_identical_tokens(routes):
    spare = await routes.add_shard(SPARE, 2, 3)
    middle = routes.shards[MIDDLE]
    sampling = SamplingParams(temperature=0.8, seed=99)
    expected = reference(PROMPT, 16, sampling)
    driver = GenerationDriver(routes, FAST)
    first_route = None

    async def kill_after_six(count: int) -> None:
        nonlocal first_route
        if count == 6:
            first_route = driver.stats.last_route
            middle.peer.kill()  # like SIGKILL: its links close, nothing more is accepted

    tokens = await collect(driver.generate(routes.model, PROMPT, sampling, 16), on_token=kill_after_six)
    assert tokens == expected
    assert driver.stats.reroutes == 1 and driver.stats.replay_mismatches == 0
    # The spare rebuilt the cache: the prompt's prefill, then the five tokens before the last one
    # generated as single steps at their own positions, then the rest of the generation.
    assert [c.n_tokens for c in spare.engine.calls][:6] == [len(PROMPT), 1, 1, 1, 1, 1]
    replayed = [c.first_position for c in spare.engine.calls[1:6]]
    assert replayed == list(range(len(PROMPT), len(PROMPT) + 5))
    assert first_route is not None and len(first_route) == 3
    assert driver.stats.last_route[1] != first_route[1]
    await eventually(lambda: no_sessions_anywhere(routes))
    # Gossip still announces the dead hop; the next generation avoids it from the start.
    assert await collect(driver.generate(routes.model, PROMPT, sampling, 4)) == expected[:4]
    assert driver.stats.reroutes == 1


async def test_hops_that_compute_differently_serve_one_route_and_the_mix_is_reported(caplog):
    routes = LoopbackRoutes()
    try:
        await routes.add_shard(DRIVER_INDEX, 0, 2, numerics="numpy float32; box a")
        await routes.add_shard(TAIL, 2, 4, numerics="numpy float32; box b")
        driver = GenerationDriver(routes, FAST)
        stream = driver.generate(routes.model, PROMPT, GREEDY, 6)
        assert stream.system_fingerprint is None  # no route is planned before the first token is asked for
        with caplog.at_level(logging.INFO, logger="meshnode.head"):
            assert await collect(stream) == reference(PROMPT, 6)
        assert stream.route is not None
        assert [hop.numerics for hop in stream.route.hops] == ["numpy float32; box a", "numpy float32; box b"]
        assert driver.stats.last_route_numerics == ("numpy float32; box a", "numpy float32; box b")
        assert stream.system_fingerprint == system_fingerprint(stream.route)
        assert driver.stats.last_system_fingerprint == stream.system_fingerprint
        assert "mixes numerics ([0,2) numpy float32; box a | [2,4) numpy float32; box b)" in caplog.text
    finally:
        await routes.aclose()


async def test_a_failover_to_a_spare_that_computes_differently_changes_the_fingerprint(routes, caplog):
    await routes.add_shard(SPARE, 2, 3, numerics="numpy float32; spare box")
    driver = GenerationDriver(routes, FAST)
    stream = driver.generate(routes.model, PROMPT, GREEDY, 10)
    before: list[str | None] = []

    async def kill_after_four(count: int) -> None:
        if count == 4:
            before.append(stream.system_fingerprint)
            routes.shards[MIDDLE].peer.kill()

    with caplog.at_level(logging.INFO, logger="meshnode.head"):
        assert await collect(stream, on_token=kill_after_four) == reference(PROMPT, 10)
    assert driver.stats.reroutes == 1
    assert caplog.text.count("mixes numerics") == 1  # the new route, not the first one
    assert stream.route is not None and stream.route.hops[1].numerics == "numpy float32; spare box"
    assert before[0] is not None and stream.system_fingerprint != before[0]
    assert stream.system_fingerprint == system_fingerprint(stream.route)


async def test_the_fingerprint_is_computed_once_per_route_though_the_api_asks_with_every_token(
    routes, monkeypatch
):
    import meshnode.head.route_session as route_session_module

    computed: list[object] = []

    def counting(route, *args):
        computed.append(route)
        return system_fingerprint(route, *args)

    monkeypatch.setattr(route_session_module, "system_fingerprint", counting)
    await routes.add_shard(SPARE, 2, 3, numerics="numpy float32; spare box")
    driver = GenerationDriver(routes, FAST)
    stream = driver.generate(routes.model, PROMPT, GREEDY, 10)
    seen: list[str | None] = []

    async def ask_and_kill_after_four(count: int) -> None:
        seen.append(stream.system_fingerprint)
        if count == 4:
            routes.shards[MIDDLE].peer.kill()

    assert await collect(stream, on_token=ask_and_kill_after_four) == reference(PROMPT, 10)
    assert driver.stats.reroutes == 1
    assert len(seen) == 10 and len(set(seen)) == 2  # it still follows the failover
    assert len(computed) == 2  # one digest per route, not one per token


async def test_a_hop_found_dead_is_tried_again_when_no_other_route_exists(routes):
    driver = GenerationDriver(routes, FAST)
    driver.found_dead({routes.shards[MIDDLE].node_id})  # a wrong suspicion, or it came back
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 3)) == reference(PROMPT, 3)
    assert driver.stats.reroutes == 0


async def test_a_silently_dead_hop_is_found_by_the_watchdog(routes):
    """A peer that stops answering without closing its link (a killed process behind QUIC)."""
    spare = await routes.add_shard(SPARE, 2, 3)
    middle = routes.shards[MIDDLE]
    expected = reference(PROMPT, 10)
    driver = GenerationDriver(routes, PLAIN)

    async def freeze_after_four(count: int) -> None:
        if count == 4:
            middle.engine.step_delay_s = 30.0  # never answers in time
            routes.mesh.down[middle.node_id] = True  # and no longer answers probes

    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 10), on_token=freeze_after_four)
    assert tokens == expected
    assert driver.stats.reroutes == 1
    assert len(spare.engine.calls) == 1 + 3 + (10 - 4)  # prefill, three replayed steps, six new ones
    middle.engine.step_delay_s = 0.0


async def test_a_cache_miss_re_prefills_under_the_same_route_session(routes):
    tail = routes.shards[TAIL]
    expected = reference(PROMPT, 10)
    driver = GenerationDriver(routes, PLAIN)

    async def evict_after_five(count: int) -> None:
        if count == 5:
            (key,) = {call.session for call in tail.engine.calls}
            tail.engine.release(key)  # the tail lost the session (evicted, expired, restarted)

    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 10), on_token=evict_after_five)
    assert tokens == expected
    assert (driver.stats.rebuilds, driver.stats.reroutes) == (1, 0)
    # Same session and epoch throughout, and the prompt prefilled twice.
    assert len({call.session for call in tail.engine.calls}) == 1
    assert [c.first_position for c in tail.engine.calls if c.n_tokens > 1] == [0, 0]


async def test_no_route_is_a_clear_failure(routes):
    routes.hidden.add(routes.shards[TAIL].node_id)
    driver = GenerationDriver(routes, FAST)
    model = {c.model for c in routes.candidates()}.pop()
    with pytest.raises(GenerationFailed, match=r"no route covers layers \[3, 4\)"):
        await collect(driver.generate(model, PROMPT, GREEDY, 4))
    assert driver.stats.failed == 1


async def test_a_dead_hop_without_a_spare_gives_up_with_the_gap(routes):
    driver = GenerationDriver(routes, FAST)

    async def kill_tail(count: int) -> None:
        if count == 2:
            routes.shards[TAIL].peer.kill()

    with pytest.raises(GenerationFailed, match=r"no route covers layers \[3, 4\)"):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, 10), on_token=kill_tail)
    await eventually(
        lambda: all(routes.shards[i].server.load().active_sessions == 0 for i in (DRIVER_INDEX, MIDDLE))
    )


async def test_a_hop_that_keeps_failing_exhausts_the_reroute_budget(routes):
    routes.shards[TAIL].engine.inject(FaultRule(FaultKind.CRASH, after_steps=1))
    options = DriverConfig(stall_probe_s=0.2, probe_timeout_s=0.5, budget=RecoveryBudget(reroutes=2))
    driver = GenerationDriver(routes, options)
    with pytest.raises(GenerationFailed, match="the route failed 3 times; last failure: internal"):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, 10))
    assert driver.stats.reroutes == 2


async def test_a_middle_hop_that_cannot_reach_the_tail_yet_is_waited_for(routes, caplog):
    """As when the head's gossip named the tail before the middle hop's did: its dials fail
    ("next hop unreachable") for a while, though every hop answers the head's probes."""
    middle = routes.shards[MIDDLE].server
    tail_id = routes.shards[TAIL].node_id
    dial = middle._links
    loop = asyncio.get_running_loop()
    reachable_at = loop.time() + 2.0

    async def not_yet(node_id: bytes):
        if node_id == tail_id and loop.time() < reachable_at:
            raise ConnectionError("no address for the tail yet")
        return await dial(node_id)

    middle._links = not_yet
    driver = GenerationDriver(routes, PLAIN)
    with caplog.at_level(logging.WARNING):
        tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 6))
    assert tokens == reference(PROMPT, 6)
    assert driver.stats.reroutes >= 1
    assert "every hop answers: re-routing in 0.2 s" in caplog.text
    # The middle hop's log says why; the head only heard the code passed back.
    [why, *_] = [r.getMessage() for r in caplog.records if r.name == "meshnode.dataplane.edges.server"]
    assert why.startswith("could not pass a step to the next hop: ") and why.endswith(
        "no address for the tail yet"
    )
    await eventually(lambda: no_sessions_anywhere(routes))


async def test_a_full_context_ends_the_generation_early(routes):
    # The fake engines hold 64 positions per session.
    driver = GenerationDriver(routes, FAST)
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, 200))
    assert tokens == reference(PROMPT, 64 - len(PROMPT) + 1)
    assert driver.stats.completed == 1


async def test_a_prompt_longer_than_the_context_fails_clearly(routes):
    driver = GenerationDriver(routes, FAST)
    with pytest.raises(ContextLengthExceeded, match="does not fit the model's context"):
        await collect(driver.generate(routes.model, PROMPT * 10, GREEDY, 4))


async def test_closing_mid_step_cancels_the_work_on_every_hop(routes):
    tail = routes.shards[TAIL]
    driver = GenerationDriver(routes, FAST)
    stream = driver.generate(routes.model, PROMPT, GREEDY, 50)
    assert await anext(stream) == reference(PROMPT, 1)[0]
    tail.engine.step_delay_s = 10.0  # the next step runs until something interrupts it
    step = asyncio.ensure_future(anext(stream))
    await eventually(lambda: tail.server.load().running_units == 1)
    step.cancel()  # the consumer goes away mid-step (a client disconnect cancels its handler)
    with pytest.raises(asyncio.CancelledError):
        await step
    await driver.aclose()
    report = driver.stats.last_cancel
    assert report is not None and len(report.hops) == 3
    assert report.cancel_acknowledged == report.hops
    assert report.release_acknowledged == report.hops
    await eventually(lambda: no_sessions_anywhere(routes))
    # The running step was interrupted on the engine thread, not left to run out its ten seconds.
    await eventually(lambda: tail.engine.metrics()[METRIC_STEPS_CANCELLED] == 1)
    await eventually(lambda: all(len(s.engine.released) == 1 for s in routes.shards.values()))
    assert all(
        s.server.load().running_units == s.server.load().queued_units == 0 for s in routes.shards.values()
    )
    assert (driver.stats.cancelled, driver.stats.active) == (1, 0)


async def test_closing_between_tokens_releases_without_cancelling(routes):
    driver = GenerationDriver(routes, FAST)
    stream = driver.generate(routes.model, PROMPT, GREEDY, 50)
    assert [await anext(stream) for _ in range(3)] == reference(PROMPT, 3)
    await stream.aclose()
    await eventually(lambda: no_sessions_anywhere(routes))
    assert driver.stats.closed == 1 and driver.stats.last_cancel is None
    await eventually(lambda: all(len(s.engine.released) == 1 for s in routes.shards.values()))
    assert all(s.engine.metrics()[METRIC_STEPS_CANCELLED] == 0 for s in routes.shards.values())
