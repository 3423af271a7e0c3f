"""A relayed peer slow to echo a probe, but sending on the link meanwhile, is kept, and so is
the link: seen in the NAT lab under 20% loss, where a joiner fetching layers through the relay
found its source's echo queued behind the transfer, gave the link up (ending the fetch) and
probed again."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from helpers.mesh_nodes import (
    start_relay_server,
)
from relayed_nodes import start_relayed_pair

from meshnode.membership.credentials import MeshKey
from meshnode.node import Node
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import StreamType

pytestmark = pytest.mark.timeout(60)


async def test_a_peer_that_sends_while_its_probe_echo_is_late_is_kept_with_its_link(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    relay, endpoint = await start_relay_server(mesh_key)
    nodes: list[Node] = []
    try:
        node_a, node_b = await start_relayed_pair(tmp_path, mesh_key, endpoint, nodes)
        link = node_b.link_to(node_a.node_id)
        assert link is not None and link.relay_id == endpoint.id

        async def echo_never(stream: FramedStream) -> None:
            await asyncio.sleep(3600)  # the echo is stuck behind other traffic; heartbeats still flow

        # Fault injection: A's probe handler, replaced where the dispatcher keeps it.
        registration = node_a.dispatcher._handlers[StreamType.PROBE]
        node_a.dispatcher._handlers[StreamType.PROBE] = dataclasses.replace(registration, handler=echo_never)
        assert not await node_b.probe(node_a.node_id)  # the echo is late indeed

        assert await node_b.reachable(node_a.node_id)
        assert node_b.link_to(node_a.node_id) is link and not link.is_closed
        assert node_a.node_id in node_b.state.table
    finally:
        for node in reversed(nodes):
            await node.shutdown()
        await relay.close()
