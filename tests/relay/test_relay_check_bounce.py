"""A relay check that wrongly takes a live relay for a dead one (its ping answered late, on a
lossy or busy path) registers on a new connection before it closes the old one: the relay moves
the registration over, the node is never unregistered there, and its peers keep it.

Seen under 20% loss in the NAT lab: the check closed the old connection first, the relay told
the peer probing the node that it had left, and the peer dropped it for a moment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.mesh_nodes import (
    start_relay_server,
)
from relay_helpers import new_member
from relayed_nodes import client_of, start_relayed_pair

from meshnode.membership.credentials import MeshKey
from meshnode.node import Node
from meshnode.relaylink.client import RegistrationNotNeeded, RelayCheck, RelayDialer

pytestmark = pytest.mark.timeout(60)

# The check waits half of this for its ping's answer, and the rest for the new registration
# (generous: a loaded CI machine).
CHECK_TIMEOUT_S = 4.0


async def test_a_check_that_misjudges_a_live_relay_moves_the_registration_without_a_gap(
    tmp_path: Path,
) -> None:
    mesh_key = MeshKey.generate()
    relay, endpoint = await start_relay_server(mesh_key)
    nodes: list[Node] = []
    try:
        node_a, node_b = await start_relayed_pair(tmp_path, mesh_key, endpoint, nodes)
        assert await node_b.probe(node_a.node_id)

        client = client_of(node_a)
        assert client.session is not None
        old = client.session

        def stalled(data: bytes, addr: tuple[str, int]) -> None:
            pass  # nothing reaches A on its old connection any more: the ping goes unanswered

        old.link.datagram_received = stalled
        check = asyncio.create_task(client.confirm_alive(CHECK_TIMEOUT_S))
        # Two checks at once (two peers' probes) share one: one replacement, not two.
        second = asyncio.create_task(client.confirm_alive(CHECK_TIMEOUT_S))
        while not check.done():
            registered = {node_id for node_id, _mesh in relay.core.registered_members()}
            assert node_a.node_id in registered, "the relay unregistered A while its check registered again"
            await asyncio.sleep(0.005)
        assert await check is RelayCheck.REGISTERED_AGAIN
        assert await second is RelayCheck.REGISTERED_AGAIN
        assert old.is_closed and client.session is not old and client.registrations == 2
        assert relay.core.stats.replaced == 1

        assert await node_b.reachable(node_a.node_id)
        assert node_a.node_id in node_b.state.table and node_b.node_id in node_a.state.table
    finally:
        for node in reversed(nodes):
            await node.shutdown()
        await relay.close()


async def test_a_registration_no_longer_needed_is_never_sent() -> None:
    # The old connection answered while the new one was being set up: the relay must not move
    # the registration (and end the old connection's links) for nothing.
    mesh_key = MeshKey.generate()
    relay, endpoint = await start_relay_server(mesh_key)
    member = new_member(mesh_key)
    dialer = await RelayDialer.open(member.identity, host="127.0.0.1")
    try:
        with pytest.raises(RegistrationNotNeeded):
            await dialer.register(
                endpoint, mesh_id=member.mesh_id, proof=member.proof, still_needed=lambda: False
            )
        assert relay.core.stats.registrations == 0 and relay.core.registered_members() == []
        session = await dialer.register(endpoint, mesh_id=member.mesh_id, proof=member.proof)
        assert relay.core.registered_members() == [(member.identity.node_id, member.mesh_id)]
        session.close()
    finally:
        dialer.close()
        await relay.close()
