"""Three in-process nodes over real QUIC with delta gossip: they converge, and changes and
departures reach everyone, through digest exchanges rather than whole tables."""

import base64
import time

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.membership.revocation import revoke_node
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(60)

DELTA = {"delta_gossip": True, "gossip_fanout": 2, "active_view": 4}


@pytest.fixture
async def trio(tmp_path):
    first = await start_first_node(tmp_path, **DELTA)
    second = await start_joiner(tmp_path, "second", first, **DELTA)
    third = await start_joiner(tmp_path, "third", first, **DELTA)
    nodes = [first, second, third]
    yield nodes
    for node in reversed(nodes):
        await node.shutdown()


def everyone_sees_everyone(nodes) -> bool:
    return all(
        {n.node_id for n in nodes} - {node.node_id} == set(node.state.table.peer_ids()) for node in nodes
    )


async def test_three_nodes_converge_by_digest_and_a_change_reaches_all(trio):
    first, second, third = trio
    await eventually(lambda: everyone_sees_everyone(trio))
    # The joiners learned each other from digests: their first frames carried no table. (Polled:
    # the side that answers an exchange merges before it sends its last frame, and counts the
    # exchange after.)
    await eventually(lambda: all(node.delta_gossip.exchanges > 0 for node in trio))
    third.set_load(mesh.Load(active_sessions=5))

    def change_known() -> bool:
        return all(
            node.state.table.announcement_of(third.node_id).load.active_sessions == 5
            for node in (first, second)
        )

    await eventually(change_known)


async def test_a_node_that_leaves_is_dropped_by_the_others(trio):
    first, second, third = trio
    await eventually(lambda: everyone_sees_everyone(trio))
    await third.shutdown()
    await eventually(
        lambda: third.node_id not in first.state.table and third.node_id not in second.state.table
    )


async def test_a_removal_spreads_by_digest_and_the_removed_node_is_shown_it(trio):
    first, second, third = trio
    await eventually(lambda: everyone_sees_everyone(trio))
    membership = first.state.membership
    revocation = revoke_node(
        membership.mesh_key,
        node_id=third.node_id,
        reason="test",
        issuer_id=first.node_id,
        unix_now=time.time(),
    )
    assert first.gossip.control("revoke " + base64.b64encode(revocation.SerializeToString()).decode())["ok"]
    # The second member never exchanged a GossipFrame with the admin after this: the digest
    # brought the revocation (its summary differed, its id was asked for).
    await eventually(lambda: second.state.revocations.node(third.node_id) is not None)
    await eventually(
        lambda: third.node_id not in second.state.table and third.node_id not in first.state.table
    )
    # The removed node is shown the signed revocation that names it, on one last frame.
    await eventually(lambda: third.removal.is_set())
    assert third.state.removed is not None and third.state.removed.target == third.node_id
