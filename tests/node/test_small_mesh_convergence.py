"""Issue 57's compatibility line: a three-node mesh over real QUIC converges as fast under delta
gossip as under today's full gossip, counted in heartbeats (the protocol's unit, not wall-clock).

Under full gossip the third node takes the first's whole table when it joins, and the second
hears of the third at its next exchange with either: everyone knows everyone within a beat or
two of the third's start. Delta gossip, with a fanout covering both peers, has the same bound.
"""

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(90)

# Beats from the third node's start (and from a record change) within which every node must know
# it: the two beats above, and one for a beat that began just before the event.
BEATS_TO_CONVERGE = 3
MODES = {"full": {}, "delta": {"delta_gossip": True, "gossip_fanout": 2, "active_view": 4}}


def beats(nodes) -> int:
    return max(node._heartbeat.beats for node in nodes)


def everyone_sees_everyone(nodes) -> bool:
    return all(
        {n.node_id for n in nodes} - {node.node_id} == set(node.state.table.peer_ids()) for node in nodes
    )


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_three_nodes_converge_within_the_same_beats_as_full_gossip(tmp_path, mode):
    config = MODES[mode]
    first = await start_first_node(tmp_path, **config)
    second = await start_joiner(tmp_path, "second", first, **config)
    nodes = [first, second]
    try:
        await eventually(lambda: everyone_sees_everyone(nodes))
        third = await start_joiner(tmp_path, "third", first, **config)
        nodes.append(third)
        joined_at = beats(nodes[:2])
        await eventually(lambda: everyone_sees_everyone(nodes))
        assert beats(nodes[:2]) - joined_at <= BEATS_TO_CONVERGE

        changed_at = beats(nodes)
        third.set_load(mesh.Load(active_sessions=5))
        await eventually(
            lambda: all(
                n.state.table.announcement_of(third.node_id).load.active_sessions == 5 for n in nodes[:2]
            )
        )
        assert beats(nodes) - changed_at <= BEATS_TO_CONVERGE
    finally:
        for node in reversed(nodes):
            await node.shutdown()
