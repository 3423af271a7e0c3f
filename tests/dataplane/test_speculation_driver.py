"""Speculative decoding through the driver over the loopback mesh (issue 20): three hops of fake
engines, the driver's own first hop included. The greedy text is the whole model's with speculation
on or off, drafts are really accepted, a killed middle hop mid-speculation changes nothing in the
text, seeded sampled requests speculate to the text the seed gives without speculation, and
penalised ones are never verified."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from helpers.loopback_routes import FAST, MIDDLE, SPARE, TAIL, LoopbackRoutes, collect, three_hop_routes
from helpers.loopback_routes import reference as whole_model

from engines.interface import GREEDY, SamplingParams
from meshnode.head.driver import DriverConfig, GenerationDriver

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 3, 8, 1, 9, 2, 7]
SPECULATING = DriverConfig(**{**FAST.__dict__, "speculation": True})
PLAIN = DriverConfig(**{**FAST.__dict__, "speculation": False})


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes() as routes:
        yield routes


async def test_greedy_text_is_the_same_with_speculation_on_and_off_and_drafts_are_accepted(routes):
    expected = whole_model(PROMPT, 40)
    plain = GenerationDriver(routes, PLAIN)
    assert await collect(plain.generate(routes.model, PROMPT, GREEDY, 40)) == expected
    assert plain.stats.speculative_rounds == 0
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 40)) == expected
    stats = driver.stats
    # The fake model's greedy text settles into a cycle: most rounds keep several tokens.
    assert stats.accepted_draft_tokens > 10 and stats.speculative_rounds < 30
    assert stats.tokens == 40 and stats.replay_mismatches == 0 and stats.rebuilds == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 13])
async def test_speculation_yields_exactly_max_tokens(routes, max_tokens):
    driver = GenerationDriver(routes, SPECULATING)
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, max_tokens))
    assert tokens == whole_model(PROMPT, max_tokens)


async def test_a_killed_middle_hop_mid_speculation_leaves_the_text_unchanged(routes):
    await routes.add_shard(SPARE, 2, 3)
    expected = whole_model(PROMPT, 40)
    driver = GenerationDriver(routes, SPECULATING)
    stream = driver.generate(routes.model, PROMPT, GREEDY, 40)
    accepted_at_kill = -1

    async def kill_the_middle_once_drafts_were_accepted(count: int) -> None:
        nonlocal accepted_at_kill
        if accepted_at_kill < 0 and driver.stats.accepted_draft_tokens > 0 and count >= 12:
            assert stream.route is not None
            middle_id = stream.route.hops[1].node_id
            (middle,) = [s for s in routes.shards.values() if s.node_id == middle_id]
            accepted_at_kill = driver.stats.accepted_draft_tokens
            # Killed between tokens of one verify round's yield, with its drafts in every cache.
            middle.peer.kill()

    tokens = await collect(stream, on_token=kill_the_middle_once_drafts_were_accepted)
    assert tokens == expected
    assert accepted_at_kill > 0 and driver.stats.reroutes == 1
    assert driver.stats.replay_mismatches == 0
    # Speculation goes on on the new route.
    assert driver.stats.accepted_draft_tokens > accepted_at_kill


async def test_generations_running_together_decode_plainly_and_batch(routes):
    """More generations at once than speculation_max_generations (1): one token a round trip, so
    that the shards batch the sessions' decodes; the text is the same greedy text."""
    driver = GenerationDriver(routes, SPECULATING)
    held = driver.generate(routes.model, [4, 4, 2, 6, 1], GREEDY, 24)
    assert await held.__anext__() == whole_model([4, 4, 2, 6, 1], 1)[0]  # running, between tokens
    try:
        assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 24)) == whole_model(PROMPT, 24)
        assert driver.stats.speculative_rounds == 0
    finally:
        await held.aclose()
    # Alone again, the same generation speculates.
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 24)) == whole_model(PROMPT, 24)
    assert driver.stats.speculative_rounds > 0


@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_a_seeded_sampled_request_speculates_to_the_text_of_its_seed(routes, seed):
    """The tail draws after each verify position as a decode there would, and a draft is kept
    while the draw equals it (the speculative-sampling rule for a one-hot draft): the text is
    the one the seed gives decoding one token a round trip, and drafts were kept."""
    sampling = SamplingParams(temperature=0.3, top_k=40, top_p=0.95, seed=seed)
    expected = whole_model(PROMPT, 40, sampling)
    plain = GenerationDriver(routes, PLAIN)
    assert await collect(plain.generate(routes.model, PROMPT, sampling, 40)) == expected
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, sampling, 40)) == expected
    assert driver.stats.speculative_rounds > 0 and driver.stats.accepted_draft_tokens > 0
    assert driver.stats.replay_mismatches == 0


async def test_a_penalised_request_decodes_one_token_a_round_trip(routes):
    sampling = SamplingParams(temperature=0.9, seed=11, presence_penalty=0.5)
    plain = await collect(GenerationDriver(routes, PLAIN).generate(routes.model, PROMPT, sampling, 16))
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, sampling, 16)) == plain
    assert driver.stats.speculative_rounds == 0 and driver.stats.draft_tokens == 0


async def test_a_verify_step_past_the_context_ends_as_plain_decoding_would(routes):
    """The shards hold 64 positions: a verify round reaching past them is refused, and the rest of
    the generation goes one token at a time, ending where plain decoding ends, with its text."""
    plain = GenerationDriver(routes, PLAIN)
    expected = await collect(plain.generate(routes.model, PROMPT, GREEDY, 100))
    assert len(expected) == 64 - len(PROMPT) + 1  # the last position's token is sampled, not fed
    tail = routes.shards[TAIL].engine
    tail.calls.clear()
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 100)) == expected
    assert driver.stats.accepted_draft_tokens > 0
    # The refused round's drafts were dropped by re-prefilling the accepted tokens once.
    assert sum(1 for call in tail.calls if call.first_position == 0) == 2


async def test_no_drafts_go_to_a_route_with_a_hop_that_does_not_announce_verify_steps(routes):
    """A node that predates speculative decoding announces no ServedShard.verifies_drafts: a route
    through it decodes one token a round trip."""
    routes.shards[MIDDLE].announcement.serving.verifies_drafts = False
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 24)) == whole_model(PROMPT, 24)
    assert driver.stats.speculative_rounds == 0
    routes.shards[MIDDLE].announcement.serving.verifies_drafts = True
    driver = GenerationDriver(routes, SPECULATING)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 24)) == whole_model(PROMPT, 24)
    assert driver.stats.speculative_rounds > 0
