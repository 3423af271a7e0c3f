"""Audits by replica over real shard servers on the loopback mesh (fake engines, bit-exact).

The driver's own node serves ``[0, 2)``, the tail ``[3, 4)``; ``[2, 3)`` has three replicas:
MIDDLE, which the routes use (the other two announce themselves busy), SPARE and THIRD. An
audit replays a generation with MIDDLE's hop on one spare and, on a dispute, has the other
decide. Every peer signs its commitments with its own node key.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator

import pytest
from helpers.loopback_routes import DRIVER_INDEX, FAST, MIDDLE, SPARE, TAIL, LoopbackRoutes, collect
from helpers.lying_engine import LayerSkippingEngine, LyingEngine
from helpers.recording_engine import RecordingEngine

from engines.interface import GREEDY, SamplingParams
from meshnode.app.audit_status import audit_section
from meshnode.audit.commitment import open_commitment
from meshnode.audit.comparison import Conviction
from meshnode.audit.evidence import encode_evidence, verify_evidence_bytes
from meshnode.head.driver import DriverConfig, GenerationDriver

pytestmark = pytest.mark.timeout(120)

THIRD = 5
PROMPT = [5, 3, 8, 1, 9, 2, 7]
TOKENS = 8
LIE_EVERY = 20
SESSIONS = 8


def plain(audit_rate: float) -> DriverConfig:
    return DriverConfig(**{**FAST.__dict__, "speculation": False, "audit_rate": audit_rate})


async def replicated_routes(
    middle: type[RecordingEngine] = RecordingEngine, **middle_options: object
) -> LoopbackRoutes:
    routes = LoopbackRoutes(signed=True)
    # Room for four generations at once and an audit's replay beside them.
    room = {"max_sessions": SESSIONS}
    await routes.add_shard(DRIVER_INDEX, 0, 2, **room)
    await routes.add_shard(MIDDLE, 2, 3, middle, **room, **middle_options)
    for spare in (SPARE, THIRD):
        shard = await routes.add_shard(spare, 2, 3, **room)
        # Busy as gossip tells it: generations go through MIDDLE; audits still use the spares.
        shard.announcement.load.active_sessions = SESSIONS - 2
    await routes.add_shard(TAIL, 3, 4, **room)
    return routes


@pytest.fixture
async def liar_routes() -> AsyncIterator[LoopbackRoutes]:
    routes = await replicated_routes(LyingEngine, lie_every=LIE_EVERY, seed=11)
    try:
        yield routes
    finally:
        await routes.aclose()


def generations_predicted(audit_rate: float, units_per_generation: int, lie_every: int) -> float:
    """Expected generations until one that carries a lie is audited."""
    lies_in_one = 1 - (1 - 1 / lie_every) ** units_per_generation
    return 1 / (audit_rate * lies_in_one)


async def test_a_liar_is_caught_within_the_generations_the_audit_rate_predicts(liar_routes):
    routes = liar_routes
    audit_rate = 0.25
    driver = GenerationDriver(routes, plain(audit_rate), audit_rng=random.Random(3))
    middle = routes.shards[MIDDLE]
    # One prefill and TOKENS - 1 decodes a generation, each a unit on the liar's hop.
    predicted = generations_predicted(audit_rate, TOKENS, LIE_EVERY)
    bound = math.ceil(4 * predicted)  # P(no conviction by then) = e^-4 ≈ 2 %
    generations = 0
    while not driver.convicted and generations < bound:
        stream = driver.generate(routes.model, PROMPT, GREEDY, TOKENS)
        await collect(stream)
        generations += 1
        await driver.auditor.settled()
    stats = driver.auditor.stats
    assert list(driver.convicted) == [middle.node_id], (generations, bound, stats)
    assert generations <= bound
    assert stats.convictions == 1 and stats.disputes == 1 and stats.undecided == 0
    # The honest neighbours, and the replicas that decided, were never accused.
    evidence = driver.convicted[middle.node_id]
    verdict = verify_evidence_bytes(encode_evidence(evidence))
    assert verdict.convicted and verdict.accused == middle.node_id
    witnesses = {routes.shards[i].node_id for i in (SPARE, THIRD)}
    assert {bytes(open_commitment(w).node_id) for w in evidence.witnesses} == witnesses
    # What meshnode status shows carries the evidence as the file `meshnode audit verify` reads.
    (shown,) = audit_section(driver)["convicted"]
    assert shown["node_id"] == middle.node_id.hex() and shown["verdict"] == verdict.detail
    assert verify_evidence_bytes(json.dumps(shown["evidence"]).encode()).accused == middle.node_id
    # From now on no route goes through the liar, although it is still announced.
    assert middle.node_id in {c.node_id for c in routes.candidates()}
    stream = driver.generate(routes.model, PROMPT, GREEDY, 3)
    await collect(stream)
    assert stream.route is not None and middle.node_id not in stream.route.node_ids
    await driver.aclose()


async def test_a_node_skipping_its_layer_is_caught_by_the_first_audit():
    routes = await replicated_routes(LayerSkippingEngine)
    try:
        driver = GenerationDriver(routes, plain(1.0), audit_rng=random.Random(5))
        told: list[Conviction] = []  # a node's head hands each conviction to gossip this way
        driver.conviction_listeners.append(told.append)
        await collect(driver.generate(routes.model, PROMPT, GREEDY, 4))
        await driver.auditor.settled()
        assert list(driver.convicted) == [routes.shards[MIDDLE].node_id]
        assert [c.accused for c in told] == [routes.shards[MIDDLE].node_id]
        assert verify_evidence_bytes(
            encode_evidence(driver.convicted[routes.shards[MIDDLE].node_id])
        ).convicted
        await driver.aclose()
    finally:
        await routes.aclose()


async def test_honest_replicas_with_batching_and_speculation_are_never_convicted():
    routes = await replicated_routes()
    try:
        # Every generation audited; speculation on for the ones that run alone.
        driver = GenerationDriver(
            routes, DriverConfig(**{**FAST.__dict__, "audit_rate": 1.0}), audit_rng=random.Random(7)
        )
        prompts = [PROMPT, [4, 4, 2], [9, 1, 1, 3, 6], [2, 7, 1, 8, 2, 8], [1, 2, 1, 2, 1, 2, 1]]
        sampled = SamplingParams(temperature=0.8, seed=4)
        runs = 0
        for round_index in range(4):
            # Alone: speculative verify rounds (prompt lookup drafts on the repeating prompt).
            await collect(driver.generate(routes.model, prompts[4], GREEDY, 10))
            # Together: their decodes share engine batches on every hop.
            await asyncio.gather(
                *(
                    collect(driver.generate(routes.model, p, sampled if round_index % 2 else GREEDY, 8))
                    for p in prompts[:4]
                )
            )
            runs += 5
            await driver.auditor.settled()
        stats = driver.auditor.stats
        assert driver.stats.speculative_rounds > 0
        assert max(len(b) for s in routes.shards.values() for b in s.engine.batches) > 1
        assert stats.audited == runs and stats.units_compared > 0, stats
        assert stats.disputes == 0 and stats.convictions == 0 and not driver.convicted
        await driver.aclose()
    finally:
        await routes.aclose()
