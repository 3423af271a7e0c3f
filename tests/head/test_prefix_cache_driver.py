"""The prefix cache through the generation driver, over real shard servers on the in-process
loopback mesh (fake engines): a conversation's next turn starts from what every hop kept."""

from __future__ import annotations

import asyncio

import pytest
from helpers.loopback_routes import DRIVER_INDEX, FAST, MIDDLE, TAIL, LoopbackRoutes, collect, reference
from helpers.polling import eventually

from engines.interface import GREEDY, METRIC_PREFIX_HITS, METRIC_PREFIX_MISSES
from meshnode.head.driver import DriverConfig, GenerationDriver

pytestmark = pytest.mark.timeout(60)

PLAIN = DriverConfig(**{**FAST.__dict__, "speculation": False})


def turn(length: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 30 + 1 for i in range(length)]


async def three_hops(entries: int) -> LoopbackRoutes:
    routes = LoopbackRoutes()
    for index, (start, end) in ((DRIVER_INDEX, (0, 2)), (MIDDLE, (2, 3)), (TAIL, (3, 4))):
        await routes.add_shard(index, start, end, max_context=2048, prefix_cache_entries=entries)
    return routes


def idle(routes: LoopbackRoutes) -> bool:
    """No session open anywhere, and every engine that ran one has released it (kept its blocks)."""
    return all(
        s.server.load().active_sessions == 0 and len(s.engine.released) >= bool(s.engine.calls)
        for s in routes.shards.values()
    )


async def test_the_next_turn_prefills_only_what_follows_the_kept_prefix_with_the_same_tokens():
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, PLAIN)
        first_prompt = turn(300, 1)
        answer = await collect(driver.generate(routes.model, first_prompt, GREEDY, 5))
        assert answer == reference(first_prompt, 5)
        await eventually(lambda: idle(routes))
        for shard in routes.shards.values():
            # The grid: whole blocks of 128, then the rest.
            assert [c.n_tokens for c in shard.engine.calls][:3] == [128, 128, 44]
            shard.engine.calls.clear()
        second_prompt = [*first_prompt, *answer, *turn(100, 2)]
        stream = driver.generate(routes.model, second_prompt, GREEDY, 5)
        tokens = await collect(stream)
        assert tokens == reference(second_prompt, 5)
        # Every hop rounds a prefill row alike in any pass of 8 rows or more (the fake engine), so
        # the first prompt's last 44 positions were kept too: all 300 of it.
        assert stream.cached_tokens == 300
        for shard in routes.shards.values():
            # Every hop started its session from the prompt it kept, up to the grid, then on it.
            assert [(c.first_position, c.n_tokens) for c in shard.engine.calls[:2]] == [(300, 84), (384, 21)]
            assert shard.engine.calls[0].prefix_digest and shard.engine.calls[0].block_digest
            assert shard.engine.metrics()[METRIC_PREFIX_HITS] == 1
        assert driver.stats.prefix_hits == 1 and driver.stats.prefix_cached_tokens == 300
    finally:
        await routes.aclose()


async def test_a_route_with_a_hop_whose_rows_depend_on_the_pass_keeps_only_whole_blocks():
    routes = LoopbackRoutes()
    try:
        await routes.add_shard(DRIVER_INDEX, 0, 2, max_context=2048, prefix_cache_entries=4)
        # As repacked weights or a GPU: it does not announce keeping partial blocks.
        await routes.add_shard(MIDDLE, 2, 3, max_context=2048, prefix_cache_entries=4, exact_numerics=False)
        await routes.add_shard(TAIL, 3, 4, max_context=2048, prefix_cache_entries=4)
        driver = GenerationDriver(routes, PLAIN)
        first_prompt = turn(300, 1)
        answer = await collect(driver.generate(routes.model, first_prompt, GREEDY, 5))
        await eventually(lambda: idle(routes))
        for shard in routes.shards.values():
            # No hop is sent the partial last chunk's digest: on this route it is not kept.
            assert [bool(c.block_digest) for c in shard.engine.calls[:3]] == [True, True, False]
            shard.engine.calls.clear()
        second_prompt = [*first_prompt, *answer, *turn(100, 2)]
        stream = driver.generate(routes.model, second_prompt, GREEDY, 5)
        assert await collect(stream) == reference(second_prompt, 5)
        assert stream.cached_tokens == 256
        for shard in routes.shards.values():
            assert shard.engine.calls[0].first_position == 256 and shard.engine.calls[0].prefix_digest
    finally:
        await routes.aclose()


async def test_a_partial_block_is_kept_and_started_from_only_as_a_pass_of_eight_rows_or_more():
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, PLAIN)
        # 4 rows past the last whole block: too small a pass to stand for a fresh prefill's.
        short_tail = turn(260, 1)
        await collect(driver.generate(routes.model, short_tail, GREEDY, 1))
        await eventually(lambda: idle(routes))
        head = routes.shards[DRIVER_INDEX].engine
        assert [bool(c.block_digest) for c in head.calls[:3]] == [True, True, False]
        stream = driver.generate(routes.model, [*short_tail, *turn(40, 2)], GREEDY, 2)
        assert await collect(stream) == reference([*short_tail, *turn(40, 2)], 2)
        assert stream.cached_tokens == 256
        await eventually(lambda: idle(routes))
        # That prompt (300 tokens) was kept whole; a next prompt 3 tokens longer would start it with
        # a 3-row pass, so it starts from the last whole block instead.
        head.calls.clear()
        longer = [*short_tail, *turn(40, 2), 5, 6, 7]
        stream = driver.generate(routes.model, longer, GREEDY, 2)
        assert await collect(stream) == reference(longer, 2)
        assert stream.cached_tokens == 256
        assert [(c.first_position, c.n_tokens) for c in head.calls[:1]] == [(256, 47)]
    finally:
        await routes.aclose()


async def test_a_hop_that_dropped_the_prefix_costs_a_full_prefill_not_the_answer():
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, PLAIN)
        first_prompt = turn(300, 1)
        await collect(driver.generate(routes.model, first_prompt, GREEDY, 3))
        await eventually(lambda: idle(routes))
        # The middle hop loses what it kept (as an eviction for room or age would).
        middle = routes.shards[MIDDLE].engine
        assert middle.clear_prefix_cache() == 1
        second_prompt = [*first_prompt, *turn(90, 3)]
        stream = driver.generate(routes.model, second_prompt, GREEDY, 4)
        assert await collect(stream) == reference(second_prompt, 4)
        assert stream.cached_tokens == 0
        assert middle.metrics()[METRIC_PREFIX_MISSES] == 1
        assert driver.stats.prefix_misses == 1 and driver.stats.rebuilds == 0
    finally:
        await routes.aclose()


async def test_every_hop_gets_the_block_digests_and_the_next_turn_prefers_the_route_that_kept_them():
    routes = LoopbackRoutes()
    try:
        await routes.add_shard(DRIVER_INDEX, 0, 2, max_context=2048, prefix_cache_entries=4)
        first_tail = await routes.add_shard(MIDDLE, 2, 4, max_context=2048, prefix_cache_entries=4)
        other_tail = await routes.add_shard(TAIL, 2, 4, max_context=2048, prefix_cache_entries=4)
        driver = GenerationDriver(routes, PLAIN)
        prompt = turn(300, 4)
        await collect(driver.generate(routes.model, prompt, GREEDY, 3))
        await eventually(lambda: idle(routes))
        used = first_tail if first_tail.engine.calls else other_tail
        unused = other_tail if used is first_tail else first_tail
        head_digests = [c.block_digest for c in routes.shards[DRIVER_INDEX].engine.calls[:3]]
        # Whole blocks carry a digest, and the partial last one (44 rows), the same at every hop.
        assert [bool(d) for d in head_digests] == [True, True, True]
        assert [c.block_digest for c in used.engine.calls[:3]] == head_digests
        # The replica that kept the prefix now looks busier than the other, not much busier.
        used.announcement.load.active_sessions = 1
        unused.engine.calls.clear()
        second = [*prompt, *turn(50, 5)]
        stream = driver.generate(routes.model, second, GREEDY, 3)
        assert await collect(stream) == reference(second, 3)
        assert stream.cached_tokens == 300 and driver.stats.prefix_route_preferred == 1
        assert unused.engine.calls == []
        # Much busier: the idle replica takes the next one and prefills it all.
        await eventually(lambda: idle(routes))
        used.announcement.load.active_sessions = 3
        third = [*prompt, *turn(60, 6)]
        stream = driver.generate(routes.model, third, GREEDY, 3)
        assert await collect(stream) == reference(third, 3)
        assert stream.cached_tokens == 0 and unused.engine.calls
    finally:
        await routes.aclose()


async def test_speculation_and_batches_keep_the_same_tokens_with_a_kept_prefix():
    routes = await three_hops(entries=4)
    try:
        # Speculation on (FAST): verify steps write draft positions that are never kept.
        driver = GenerationDriver(routes, FAST)
        prompt = [*turn(200, 7), *turn(100, 7)]  # repeats: prompt lookup drafts
        answer = await collect(driver.generate(routes.model, prompt, GREEDY, 24))
        assert answer == reference(prompt, 24)
        assert driver.stats.speculative_rounds > 0
        await eventually(lambda: idle(routes))
        second = [*prompt, *answer, *turn(40, 8)]
        # Two conversations at once continue from the same kept prefix: their decodes batch.
        streams = [driver.generate(routes.model, second, GREEDY, 16) for _ in range(2)]
        results = await asyncio.gather(*(collect(stream) for stream in streams))
        assert results == [reference(second, 16)] * 2
        # One adopted the kept prefix (the prompt, and the answer kept after it); the other found it
        # taken and prefilled from 0.
        assert sorted(stream.cached_tokens for stream in streams) == [0, 324]
    finally:
        await routes.aclose()


async def test_the_answer_is_kept_after_its_prompt_so_the_next_turn_starts_after_both():
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, PLAIN)
        assert driver.answers is not None
        first_prompt = turn(300, 1)
        answer = await collect(driver.generate(routes.model, first_prompt, GREEDY, 16))
        # Sent at once: it waits for the answer to be kept rather than prefilling it again.
        second_prompt = [*first_prompt, *answer, *turn(60, 2)]
        stream = driver.generate(routes.model, second_prompt, GREEDY, 16)
        second_answer = await collect(stream)
        assert second_answer == reference(second_prompt, 16)
        assert stream.cached_tokens == 316
        assert driver.stats.answers_kept == 1 and driver.stats.answer_tokens_kept == 16
        assert driver.stats.answer_waits == 1
        # Each hop prefilled the answer from the kept prompt (316 = 300 + 16), never from 0.
        for shard in routes.shards.values():
            prefills = [(c.first_position, c.n_tokens) for c in shard.engine.calls if c.first_position != 0]
            assert (300, 16) in prefills and (316, 60) in prefills
            assert [c.first_position for c in shard.engine.calls].count(0) == 1
        await eventually(lambda: idle(routes) and driver.stats.answers_kept == 2)
        third_prompt = [*second_prompt, *second_answer, *turn(20, 3)]
        stream = driver.generate(routes.model, third_prompt, GREEDY, 4)
        assert await collect(stream) == reference(third_prompt, 4)
        assert stream.cached_tokens == len(second_prompt) + 16
    finally:
        await routes.aclose()


async def test_an_answer_is_not_kept_where_it_would_prefill_from_zero_short_or_asked_not_to():
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, PLAIN)
        assert driver.answers is not None
        first_prompt = turn(300, 1)
        await collect(driver.generate(routes.model, first_prompt, GREEDY, 7))
        await eventually(lambda: idle(routes))
        # 7 tokens: too small a pass to keep.
        assert driver.stats.answers_kept == 0
        # A prompt too short for any kept block: nothing to prefill the answer after (and no
        # prefill of the prompt from 0 for it).
        for shard in routes.shards.values():
            shard.engine.calls.clear()
        await collect(driver.generate(routes.model, turn(5, 4), GREEDY, 12))
        await eventually(lambda: idle(routes))
        assert [c.first_position for c in routes.shards[DRIVER_INDEX].engine.calls if c.n_tokens > 1] == [0]
        assert driver.stats.answers_kept == driver.stats.answers_not_kept == 0
        # A hop with no session to spare besides the keep's (as the head sees its load): not kept,
        # and no session opened for it.
        middle = routes.shards[MIDDLE]
        middle.announcement.load.active_sessions = middle.announcement.capacity.max_concurrent_sessions - 1
        for shard in routes.shards.values():
            shard.engine.calls.clear()
        route = driver.plan(routes.model, set())
        driver.answers.keep(routes.model, route, first_prompt, turn(20, 9))
        await eventually(lambda: driver.stats.answers_not_kept == 1)
        assert all(not s.engine.calls for s in routes.shards.values())
        middle.announcement.load.active_sessions = 0
        # A hop lost the prompt: the keep ends at its refusal instead of prefilling from 0.
        assert routes.shards[MIDDLE].engine.clear_prefix_cache() == 1
        for shard in routes.shards.values():
            shard.engine.calls.clear()
        route = driver.plan(routes.model, set())
        driver.answers.keep(routes.model, route, first_prompt, turn(20, 9))
        await eventually(lambda: driver.stats.answers_not_kept == 2)
        assert all(c.first_position == 300 for s in routes.shards.values() for c in s.engine.calls)
        await eventually(lambda: idle(routes))
    finally:
        await routes.aclose()
    routes = await three_hops(entries=4)
    try:
        driver = GenerationDriver(routes, DriverConfig(**{**PLAIN.__dict__, "keep_answers": False}))
        assert driver.answers is None
        await collect(driver.generate(routes.model, turn(300, 1), GREEDY, 16))
        await eventually(lambda: idle(routes))
        for shard in routes.shards.values():
            # The prompt's three chunks, then one-token decodes: nothing prefilled after it.
            assert [c.first_position for c in shard.engine.calls if c.n_tokens > 1] == [0, 128, 256]
    finally:
        await routes.aclose()
