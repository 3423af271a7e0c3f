"""A shard server quarantines on the evidence its node holds (meshnode.dataplane.hop_rules): real
shard servers on the loopback mesh (fake engines), every peer signing.

The driver's own node serves ``[0, 2)``, MIDDLE ``[2, 3)``, TAIL ``[3, 4)``. MIDDLE's node holds
verified evidence against TAIL (its evidence keeper, as gossip fills it); the head does not yet.
Under a policy that quarantines on evidence MIDDLE refuses every session whose route forwards to
TAIL, so the head cannot keep using TAIL through the honest MIDDLE; without that policy, or once
an admin cleared TAIL, it serves the route as before.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from helpers.loopback_routes import (
    FAST,
    MIDDLE,
    SPARE,
    TAIL,
    LoopbackRoutes,
    collect,
    reference,
    three_hop_routes,
)

from audit.signed_evidence import evidence_against, report
from engines.interface import GREEDY
from meshnode.head.driver import GenerationDriver
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.mesh_policy import sign_policy
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.wire.errors import MeshnodeError
from meshnode.wire.pb import shard

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 3, 8, 1, 9, 2, 7]
TOKENS = 3
MESH_KEY = MeshKey.from_seed(b"\x07" * 32)
ADMIN = NodeIdentity.from_seed(b"\x70" * 32)
REPORTER = NodeIdentity.from_seed(b"\x71" * 32)
WITNESSES = (NodeIdentity.from_seed(b"\x61" * 32), NodeIdentity.from_seed(b"\x62" * 32))


@pytest.fixture
async def routes() -> AsyncIterator[LoopbackRoutes]:
    async with three_hop_routes(signed=True) as routes:
        yield routes


def set_policy(keeper: EvidenceKeeper, *, at: float, quarantine: bool, cleared=()) -> None:
    signed = sign_policy(
        MESH_KEY, issuer_id=ADMIN.node_id, unix_now=at, quarantine_on_evidence=quarantine, cleared=cleared
    )
    assert keeper.learn_policy(signed)


async def test_a_hop_refuses_a_route_to_a_node_its_node_quarantines_and_serves_it_once_cleared(routes):
    middle, tail = routes.shards[MIDDLE], routes.shards[TAIL]
    tail_identity = routes.identity(TAIL)
    middle_identity = routes.identity(MIDDLE)
    assert tail_identity is not None and middle_identity is not None
    keeper = EvidenceKeeper(middle_identity, MESH_KEY.mesh_id)
    keeper.learn(
        [report(REPORTER, evidence_against(tail_identity, WITNESSES), MESH_KEY.mesh_id)], b"\x01" * 32
    )
    assert keeper.accused() == {tail.node_id}
    middle.server.worker.rules = keeper

    # Evidence without a quarantine policy: this hop forwards to the accused as before.
    driver = GenerationDriver(routes, FAST)
    assert await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS)) == reference(PROMPT, TOKENS)

    now = time.time()
    set_policy(keeper, at=now, quarantine=True)
    assert keeper.quarantined() == {tail.node_id}
    tail.engine.calls.clear()
    with pytest.raises(MeshnodeError):
        await collect(driver.generate(routes.model, PROMPT, GREEDY, TOKENS))
    assert middle.server.errors_sent[shard.ERROR_CODE_PAYLOAD_CORRUPT] >= 1
    # Not a unit reached the quarantined node through the honest hop.
    assert not tail.engine.calls

    # Another replica of the tail's range takes the route once the head leaves the accused out.
    await routes.add_shard(SPARE, 3, 4)
    routes.hidden = {tail.node_id}
    stream = driver.generate(routes.model, PROMPT, GREEDY, TOKENS)
    assert await collect(stream) == reference(PROMPT, TOKENS)
    assert stream.route is not None and routes.shards[SPARE].node_id in stream.route.node_ids
    routes.hidden = {routes.shards[SPARE].node_id}

    # An admin clears the accused: the hop serves routes to it again.
    set_policy(keeper, at=now + 1, quarantine=True, cleared=[tail.node_id])
    assert keeper.quarantined() == frozenset()
    stream = driver.generate(routes.model, PROMPT, GREEDY, TOKENS)
    assert await collect(stream) == reference(PROMPT, TOKENS)
    assert stream.route is not None and tail.node_id in stream.route.node_ids
    await driver.aclose()
