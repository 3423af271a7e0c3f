"""Signed handoffs over real shard servers on the loopback mesh (fake engines, bit-exact).

The driver's own node serves ``[0, 2)``, MIDDLE ``[2, 3)`` (SPARE is its replica), TAIL ``[3, 4)``;
every peer signs. A hop that commits to its honest output and passes other bytes on
(:mod:`helpers.lying_forwarder`) is either convicted by its own two signatures, when its handoff
states what it sent, or refused by its honest neighbour, when its handoff states what it
computed; the neighbour is never accused. An honest run and an older node that sends no handoff
convict nobody.
"""

from __future__ import annotations

import random
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
from helpers.lying_forwarder import Handoff, forward_other_bytes

from engines.interface import GREEDY
from meshnode.audit.commitment import open_commitment
from meshnode.audit.evidence import encode_evidence, verify_evidence_bytes
from meshnode.audit.handoff import open_handoff
from meshnode.dataplane.hop_rules import FixedHopRules
from meshnode.head.driver import DriverConfig, GenerationDriver
from meshnode.wire.errors import MeshnodeError
from meshnode.wire.pb import shard

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 3, 8, 1, 9, 2, 7]
TOKENS = 4


def audited() -> DriverConfig:
    return DriverConfig(**{**FAST.__dict__, "speculation": False, "audit_rate": 1.0})


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes(signed=True) as routes:
        yield routes


async def test_each_hop_carries_the_handoff_the_hop_before_signed_and_an_honest_run_convicts_nobody(routes):
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(1))
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS)) == reference(PROMPT, TOKENS)
    await driver.auditor.settled()
    (session_id,) = driver.commitments.session_ids()
    kept = driver.commitments.session(session_id, now_ns=0)
    assert kept is not None
    commitments = [open_commitment(signed) for signed in kept.commitments]
    by_signer_step = {(bytes(c.node_id), c.idempotency_step): c for c in commitments}
    sender_of = {routes.shards[MIDDLE].node_id: DRIVER_INDEX, routes.shards[TAIL].node_id: MIDDLE}
    carried = 0
    for commitment in commitments:
        signer = bytes(commitment.node_id)
        if signer not in sender_of:
            # The first hop is given tokens by the head: nothing to state.
            assert not commitment.HasField("input_handoff")
            continue
        handoff = open_handoff(commitment.input_handoff)
        sender = by_signer_step[(routes.shards[sender_of[signer]].node_id, commitment.idempotency_step)]
        assert bytes(handoff.node_id) == bytes(sender.node_id)
        assert handoff.sent_digest == sender.output_digest
        carried += 1
    assert carried == 2 * TOKENS
    stats = driver.auditor.stats
    assert stats.convictions == 0 and not driver.convicted and stats.without_replica == 1
    await driver.aclose()


async def test_a_hop_that_signs_what_it_sent_against_what_it_computed_is_convicted_not_its_neighbour(routes):
    await routes.add_shard(SPARE, 2, 3)
    middle = routes.shards[MIDDLE]
    routes.hidden = {routes.shards[SPARE].node_id}
    lied = forward_other_bytes(middle.server, routes.identity(MIDDLE), Handoff.SENT)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(2))
    await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    await driver.auditor.settled()
    assert lied
    assert list(driver.convicted) == [middle.node_id]
    evidence = driver.convicted[middle.node_id]
    assert not evidence.witnesses and evidence.HasField("accused_handoff")
    verdict = verify_evidence_bytes(encode_evidence(evidence))
    assert verdict.convicted and verdict.accused == middle.node_id
    assert "passed on other bytes than it computed" in verdict.detail
    # No replay was needed, and no route goes through the forwarder from now on.
    assert driver.auditor.stats.audited == 0 and driver.auditor.stats.disputes == 0
    routes.hidden = set()
    stream = driver.generate(routes.model, PROMPT, GREEDY, 2)
    await collect(stream)
    assert stream.route is not None and middle.node_id not in stream.route.node_ids
    await driver.aclose()


async def test_bytes_other_than_the_sender_signed_are_refused_by_the_receiver_who_is_not_accused(routes):
    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    forward_other_bytes(middle.server, routes.identity(MIDDLE), Handoff.COMPUTED)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(3))
    with pytest.raises(MeshnodeError):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    await driver.auditor.settled()
    assert tail.server.errors_sent[shard.ERROR_CODE_PAYLOAD_CORRUPT] >= 1
    # The tail computed nothing on the bytes it refused, and nobody is convicted on its word.
    assert not [c for c in tail.engine.calls if c.hidden is not None]
    assert not driver.convicted
    await driver.aclose()


async def test_a_sender_that_stops_stating_what_it_sends_is_refused(routes):
    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    # The prefill (step 1) goes on with its handoff; the decodes carry other bytes and none.
    lied = forward_other_bytes(middle.server, None, Handoff.NONE, from_step=2)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(5))
    with pytest.raises(MeshnodeError):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    await driver.auditor.settled()
    assert lied and min(lied) == 2
    assert tail.server.errors_sent[shard.ERROR_CODE_PAYLOAD_CORRUPT] >= 1
    # Only prefills (the head re-routes and starts again) reached the tail's engine, never a
    # decode; nobody is convicted on the tail's word.
    assert {c.first_position for c in tail.engine.calls if c.hidden is not None} == {0}
    assert not driver.convicted
    await driver.aclose()


async def test_an_older_node_that_sends_no_handoff_is_not_convicted_for_its_absence(routes):
    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    forward_other_bytes(middle.server, None, Handoff.NONE)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(4))
    await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    await driver.auditor.settled()
    (session_id,) = driver.commitments.session_ids()
    kept = driver.commitments.session(session_id, now_ns=0)
    assert kept is not None
    tail_commitments = [c for c in map(open_commitment, kept.commitments) if bytes(c.node_id) == tail.node_id]
    assert len(tail_commitments) == TOKENS
    assert not any(c.HasField("input_handoff") for c in tail_commitments)
    # As before handoffs: what it passed on cannot be told from its neighbour's word, so no one
    # is convicted (the gap an older node leaves).
    assert not driver.convicted and driver.auditor.stats.convictions == 0
    await driver.aclose()


async def test_under_a_policy_that_requires_handoffs_a_hop_that_sends_none_is_refused(routes):
    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    # The tail's node holds the admin's policy (require_handoffs); the middle sends no handoff
    # from its first unit on, as a node that never states what it forwards does.
    tail.server.worker.rules = FixedHopRules(require_handoffs=True)
    forward_other_bytes(middle.server, None, Handoff.NONE)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(6))
    with pytest.raises(MeshnodeError):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    await driver.auditor.settled()
    # The refusal's detail (handoff_check.REQUIRED_DETAIL) stays between the hops: tests/dataplane.
    assert tail.server.errors_sent[shard.ERROR_CODE_PAYLOAD_CORRUPT] >= 1
    # The tail computed nothing on what it refused; nobody is convicted on its word.
    assert not [c for c in tail.engine.calls if c.hidden is not None]
    assert not driver.convicted
    await driver.aclose()


async def test_the_requirement_leaves_a_bfloat16_boundary_and_signing_hops_alone(routes):
    # Every hop signs its handoffs: a float32 route passes under the requirement.
    for each in routes.shards.values():
        each.server.worker.rules = FixedHopRules(require_handoffs=True)
    driver = GenerationDriver(routes, audited(), audit_rng=random.Random(7))
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS)) == reference(PROMPT, TOKENS)
    await driver.aclose()
    # On a bfloat16 boundary no hop states what it sends (the head chose it for the whole route,
    # not the sender), so the requirement does not refuse its units.
    config = DriverConfig(**{**audited().__dict__, "boundary_dtype": shard.DTYPE_BFLOAT16})
    driver = GenerationDriver(routes, config, audit_rng=random.Random(8))
    tokens = await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    assert len(tokens) == TOKENS
    assert not any(s.server.errors_sent for s in routes.shards.values())
    await driver.aclose()
