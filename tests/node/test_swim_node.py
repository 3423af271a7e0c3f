"""SWIM failure detection in a three-node mesh over real QUIC, under delta gossip: a killed node
is removed by the others within the rounds the detector predicts, and a live node suspected by
one member hears it on the gossip, makes its record fresher and is not removed."""

import math

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.mesh.failure_detector import DEFAULT_SUSPICION_ROUNDS, rounds_to_confirm

pytestmark = pytest.mark.timeout(90)

HEARTBEAT_S = 0.25
PROBE_S = 1.0
CONNECT_S = 1.0
SWIM = {
    "delta_gossip": True,
    "gossip_fanout": 2,
    "active_view": 4,
    "heartbeat_interval": HEARTBEAT_S,
    "probe_timeout": PROBE_S,
    "connect_timeout": CONNECT_S,
}


@pytest.fixture
async def trio(tmp_path):
    first = await start_first_node(tmp_path, **SWIM)
    second = await start_joiner(tmp_path, "second", first, **SWIM)
    third = await start_joiner(tmp_path, "third", first, **SWIM)
    nodes = [first, second, third]
    await eventually(
        lambda: all(
            {n.node_id for n in nodes} - {node.node_id} == set(node.state.table.peer_ids()) for node in nodes
        )
    )
    yield nodes
    for node in reversed(nodes):
        await node.shutdown()


def crash(node) -> None:
    """Its socket goes away with no PeerLeaving and no CONNECTION_CLOSE."""
    for task in node.background_tasks:
        task.cancel()
    # Fault injection: nothing public drops a socket without closing its connections.
    node.endpoint._transport.abort()


async def test_a_killed_node_is_removed_by_the_others_within_the_predicted_rounds(trio):
    first, second, killed = trio
    # Records change only with their content: no heartbeat moves a quiet one.
    sequences = [node.state.local.heartbeat_seq for node in trio]
    await eventually(lambda: all(node.delta_gossip.swim.rounds > 4 for node in trio))
    assert [node.state.local.heartbeat_seq for node in trio] == sequences
    rounds_at_kill = {node: node.delta_gossip.swim.rounds for node in (first, second)}
    crash(killed)
    # Our probe, a second chance on the link, then the helpers' (each a connect and two probes).
    probe_s = 2 * PROBE_S + CONNECT_S + 2 * PROBE_S
    predicted = rounds_to_confirm(members=2, probe_rounds=math.ceil(probe_s / HEARTBEAT_S))
    for node in (first, second):
        swim = node.delta_gossip.swim
        await eventually(lambda n=node: killed.node_id not in n.state.table, timeout=40)
        # +1: the poll reads the count up to one round after the removal.
        assert swim.rounds - rounds_at_kill[node] <= predicted + 1
        assert "suspected" in node.state.table.tombstone(killed.node_id).reason
    assert second.node_id in first.state.table and first.node_id in second.state.table


async def test_a_live_node_suspected_by_one_member_refutes_it_and_stays(trio):
    first, second, suspect = trio
    sequence = suspect.state.local.heartbeat_seq
    detector = first.delta_gossip.swim.detector
    start = first.delta_gossip.swim.rounds

    def refuted() -> bool:
        if suspect.delta_gossip.swim.refutations > 0:
            return True
        if suspect.node_id not in detector.suspects:
            # As if the first member's probe of it, and its helpers', had timed out. Again when an
            # exchange or a probe with it under way as we suspected it ended since: it answered,
            # so the first member rightly suspects it no more, before any frame carried it.
            detector.unreachable(suspect.node_id)
        return False

    # The suspicion rides on the first member's digest frames; the suspect, hearing it, signs a
    # fresher record, and the first member, hearing from it, suspects it no more.
    await eventually(refuted)
    assert suspect.state.local.heartbeat_seq > sequence
    await eventually(lambda: suspect.node_id not in first.delta_gossip.swim.detector.suspects)
    # Well past the rounds a suspicion lasts before removal, nobody removed it.
    await eventually(lambda: first.delta_gossip.swim.rounds > start + 3 * (DEFAULT_SUSPICION_ROUNDS + 1))
    for node in (first, second):
        assert suspect.node_id in node.state.table
        assert suspect.node_id not in node.delta_gossip.swim.detector.suspects
        assert node.state.table.tombstone(suspect.node_id) is None


async def test_a_live_node_wrongly_confirmed_down_learns_it_refutes_and_is_admitted_again(trio):
    first, wronged, third = trio
    swim = first.delta_gossip.swim
    sequence = wronged.state.local.heartbeat_seq
    # As if its probes, and its helpers', had failed for the suspicion's rounds: the first member
    # removes a member that is alive and serving (its tombstone holds the record it had).
    swim.confirm_down(wronged.node_id)
    assert wronged.node_id not in first.state.table
    assert first.state.table.tombstone(wronged.node_id) is not None
    start = swim.rounds
    # Its next exchange with the first member shows it the removal; it signs a fresher record,
    # which beats the tombstone, and the first member admits it again. Bounded in rounds (the
    # wronged node's view takes the first member back, a link, a frame and a digest), far
    # within the tombstone's life (60 s, 240 rounds), which is what kept it out before.
    bound = 40
    await eventually(lambda: wronged.node_id in first.state.table or swim.rounds > start + bound, timeout=40)
    assert wronged.node_id in first.state.table, f"not admitted again within {bound} rounds"
    assert wronged.state.local.heartbeat_seq > sequence
    assert wronged.delta_gossip.swim.refutations > 0
    assert first.state.table.tombstone(wronged.node_id) is None
    # The fresher record spread: the third member holds it too.
    fresher = wronged.state.local.heartbeat_seq
    await eventually(lambda: third.state.table.announcement_of(wronged.node_id).heartbeat_seq == fresher)
