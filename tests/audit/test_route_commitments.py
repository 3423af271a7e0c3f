"""Hops' signed commitments reach the head on the Acks, over real shard servers on the loopback mesh.

The driver's own node serves ``[0, 2)``, peers ``[2, 3)`` (MIDDLE, and SPARE as its replica) and
``[3, 4)``; every peer signs with its node key (fake engines: bit-exact like the CPU). What an
audit rests on is checked here: every unit comes back with one commitment per hop, each signed
by that hop, and two replicas of a range given the same history state the same input and output
digests, alone or batched with other generations.
"""

from __future__ import annotations

import asyncio
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

from engines.interface import GREEDY
from meshnode.audit.commitment import is_exact, layers, open_commitment
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.wire.pb import shard

pytestmark = pytest.mark.timeout(30)

PLAIN = DriverConfig(**{**FAST.__dict__, "speculation": False})
PROMPT = [5, 3, 8, 1, 9, 2, 7]

Digests = dict[tuple[tuple[int, int], int], tuple[bytes, bytes]]


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes(signed=True) as routes:
        yield routes


def opened(driver: GenerationDriver, session_id: str) -> list[shard.UnitCommitment]:
    kept = driver.commitments.session(session_id, now_ns=0)
    assert kept is not None and not kept.truncated
    return [open_commitment(signed) for signed in kept.commitments]


def digests(commitments: list[shard.UnitCommitment]) -> Digests:
    """(layers, step) -> (input digest, output digest)."""
    found: Digests = {}
    for c in commitments:
        key = (layers(c), c.idempotency_step)
        assert key not in found
        found[key] = (bytes(c.input_digest), bytes(c.output_digest))
    return found


async def test_every_unit_comes_back_with_each_hops_signed_commitment(routes):
    driver = GenerationDriver(routes, PLAIN)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, 6)) == reference(PROMPT, 6)
    (session_id,) = driver.commitments.session_ids()
    commitments = opened(driver, session_id)
    # One prefill and five decodes, each committed to by the three hops, in route order.
    assert len(commitments) == 6 * 3
    signers = [routes.shards[i].node_id for i in (DRIVER_INDEX, MIDDLE, TAIL)]
    for unit in range(6):
        per_hop = commitments[unit * 3 : unit * 3 + 3]
        assert [bytes(c.node_id) for c in per_hop] == signers
        assert [layers(c) for c in per_hop] == [(0, 2), (2, 3), (3, 4)]
        assert {c.idempotency_step for c in per_hop} == {unit + 1}
        assert all(is_exact(c) and c.route_session_id == session_id for c in per_hop)
    # Each unit's input digest chains onto the last one's: no two are alike on one hop.
    assert len({c.input_digest for c in commitments}) == len(commitments)


async def test_replicas_given_the_same_history_state_the_same_digests(routes):
    await routes.add_shard(SPARE, 2, 3)
    driver = GenerationDriver(routes, PLAIN)
    runs: list[Digests] = []
    for hidden in (routes.shards[SPARE].node_id, routes.shards[MIDDLE].node_id):
        routes.hidden = {hidden}
        await collect(driver.generate(routes.model, PROMPT, GREEDY, 8))
        session_id = driver.commitments.session_ids()[-1]
        commitments = opened(driver, session_id)
        assert hidden not in {bytes(c.node_id) for c in commitments}
        runs.append(digests(commitments))
    assert runs[0] == runs[1]


async def test_batching_with_other_generations_changes_no_digest(routes):
    driver = GenerationDriver(routes, PLAIN)
    await collect(driver.generate(routes.model, PROMPT, GREEDY, 8))
    alone = digests(opened(driver, driver.commitments.session_ids()[0]))
    others = [[4, 4, 2], [9, 1, 1, 3, 6], PROMPT]
    await asyncio.gather(
        *(collect(driver.generate(routes.model, prompt, GREEDY, 8)) for prompt in [PROMPT, *others])
    )
    batched_ids = driver.commitments.session_ids()[1:]
    batched = [digests(opened(driver, session_id)) for session_id in batched_ids]
    # The two runs of PROMPT beside others state exactly what it stated alone.
    assert sum(run == alone for run in batched) == 2
    assert max(len(batch) for s in routes.shards.values() for batch in s.engine.batches) > 1
