"""Relayed peers stay in the mesh when the relay their link goes through dies.

Two relay-only nodes (NAT stand-ins, in this process) register with two real
``meshnode relay`` processes, and each announces both. The relay their link
uses is killed with SIGKILL: it sends no CONNECTION_CLOSE, so both nodes'
connections to it look alive until their idle timeout (15 s). Before, each
node's heartbeat and then its probe went through the dead relay and it dropped
the other (seen by hand at default timing: dropped at +11 s, back at +25 s).
Now a probe unanswered on a relayed link is retried through the peer's other
relay (once the dead one has left a ping unanswered), and neither node drops the other.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_invited_node
from helpers.polling import eventually
from helpers.relay_process import start_relay_process

from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.node import Node
from meshnode.relaylink.client import RelayClientConfig

pytestmark = pytest.mark.timeout(90)

# Longer than the nodes take to drop an unanswering peer (heartbeat 0.3 s, gossip and
# probe timeouts 2 s each) and shorter than a relay connection's idle timeout (15 s).
WATCH_S = 9.0
RELAY_IDLE_TIMEOUT_S = RelayClientConfig().quic.idle_timeout


def announced_relays(viewer: Node, peer: Node) -> set[bytes]:
    for entry in viewer.peers():
        if entry.peer_id == peer.node_id:
            return {bytes(r.relay_id) for r in entry.announcement.relays}
    return set()


def registered_with(node: Node) -> set[bytes]:
    return {bytes.fromhex(r.id) for r in node.status().node.relays if r.registered}


async def test_peers_move_to_their_other_relay_when_theirs_dies_without_closing(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    relays: list[tuple[subprocess.Popen[str], Endpoint]] = []
    nodes: list[Node] = []
    try:
        for name in ("r1", "r2"):
            relays.append(await start_relay_process(tmp_path / name, mesh_key.mesh_id))
        endpoints = [endpoint for _process, endpoint in relays]
        both = {endpoint.id for endpoint in endpoints}
        node_a = first_member(tmp_path / "a", relay_only_config(relays=endpoints), mesh_key)
        nodes.append(node_a)
        await node_a.start()
        # The joiner may reach A through either relay: A must be registered with both first.
        await eventually(lambda: registered_with(node_a) == both, timeout=20)
        invite = invite_from(node_a, relays=endpoints)
        node_b = await start_invited_node(tmp_path / "b", relay_only_config(relays=endpoints), invite)
        nodes.append(node_b)

        await eventually(
            lambda: (
                registered_with(node_a) == registered_with(node_b) == both
                and announced_relays(node_a, node_b) == announced_relays(node_b, node_a) == both
            ),
            timeout=20,
        )
        assert await node_a.probe(node_b.node_id)
        used_link = node_a.link_to(node_b.node_id)
        assert used_link is not None and used_link.relay_id in both
        (dead_process,) = [process for process, endpoint in relays if endpoint.id == used_link.relay_id]
        (other_relay,) = both - {used_link.relay_id}

        dead_process.kill()
        dead_process.wait(10)

        def moved(node: Node, peer: Node) -> bool:
            link = node.link_to(peer.node_id)
            return link is not None and link.relay_id == other_relay

        loop = asyncio.get_running_loop()
        killed_at = loop.time()
        watch_until = killed_at + WATCH_S
        # When both had moved: before the dead relay's connection timed out, not because it did.
        moved_after: float | None = None
        while loop.time() < watch_until:
            assert node_b.node_id in node_a.state.table, "A dropped B although another relay reaches it"
            assert node_a.node_id in node_b.state.table, "B dropped A although another relay reaches it"
            if moved_after is None and moved(node_a, node_b) and moved(node_b, node_a):
                moved_after = loop.time() - killed_at
            await asyncio.sleep(0.05)

        assert moved_after is not None and moved_after < RELAY_IDLE_TIMEOUT_S, moved_after
        assert await node_a.probe(node_b.node_id)
        assert await node_b.probe(node_a.node_id)
        assert moved(node_a, node_b) and moved(node_b, node_a)
    finally:
        for node in reversed(nodes):
            await node.shutdown()
        for process, _endpoint in relays:
            process.kill()
            process.wait(10)
