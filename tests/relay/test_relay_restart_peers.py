"""A relay that restarts does not make its nodes drop each other, whether it closed its
connections on the way down or was killed (SIGKILL) and left them looking alive.

When a relay restarts, its nodes register again one by one. The first one back used to
heartbeat a peer not yet back, hear from the relay "not registered here", probe it, hear the
same at once, and drop it (seen in the NAT lab: B dropped A 0.4 s before A registered again).
Now a probe refused outright is retried until a probe's time has passed.

Node A is a real ``meshnode`` process, stopped (SIGSTOP) while the relay restarts so that it
registers again well after B does; B runs in this process. Both reach each other only
through the relay.

Killed, the relay sends no CONNECTION_CLOSE: its nodes' connections looked alive until their
idle timeout (15 s), the restarted relay ignored them, and the nodes dropped each other after
a probe (about 5 s in) until the timeout let them register again. Now a node whose probe
through its relay goes unanswered pings the relay on that connection, and one that answers
nothing is registered with again at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import pytest
from helpers.mesh_nodes import invite_to, relay_only_config, start_invited_node
from helpers.node_processes import NODE_TIMING, NodeProcess, write_member
from helpers.polling import eventually
from helpers.relay_process import relay_option, start_relay_process
from relayed_nodes import client_of, start_relayed_pair

from meshnode.membership.credentials import MeshKey
from meshnode.node import Node

pytestmark = pytest.mark.timeout(120)

# How long A stays stopped once the relay is back: B registers again within about 0.5 s
# and heartbeats every 0.3 s, so it asks for A several times before A is back.
A_STOPPED_S = 1.5
# B's probe timeout: a refused probe is retried for this long, past A's return. It also covers
# the relay's own restart (a new process: under a load average of 7 on 2 cores that took long
# enough for a 5 s timeout to drop A before the relay was back, once in a whole-suite run);
# the behaviour under test, a refusal retried rather than taken at once, does not depend on it.
B_PROBE_TIMEOUT_S = 10.0


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_nodes_keep_each_other_while_a_restarted_relay_registers_them_again(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    listen = f"127.0.0.1:{free_udp_port()}"
    relay, endpoint = await start_relay_process(tmp_path / "relay", mesh_key.mesh_id, "--listen", listen)
    node_a = NodeProcess(tmp_path, "a")
    a_id = write_member(node_a.data_dir, mesh_key).node_id
    node_b = None
    try:
        node_a.start(
            "start",
            *("--listen", "127.0.0.1:0", "--relay-only", "--relay", relay_option(endpoint)),
            *("--api-listen", "off", *NODE_TIMING),
        )

        def a_registered() -> bool:
            status = node_a.live_status()
            return status is not None and any(r["registered"] for r in status["node"]["relays"])

        await eventually(a_registered, timeout=30)
        status = node_a.live_status()
        assert status is not None
        invite = invite_to(mesh_key, a_id, status["node"]["addresses"][0], [endpoint])
        config = relay_only_config(endpoint, probe_timeout=B_PROBE_TIMEOUT_S)
        node_b = await start_invited_node(tmp_path / "b", config, invite)

        def linked() -> bool:
            link = node_b.link_to(a_id)
            return a_id in node_b.state.table and link is not None and link.relay_id == endpoint.id

        await eventually(linked, timeout=20)
        assert await node_b.probe(a_id)

        assert node_a.process is not None
        node_a.process.send_signal(signal.SIGSTOP)
        try:
            relay.terminate()
            relay.wait(10)
            relay, _same = await start_relay_process(tmp_path / "relay", mesh_key.mesh_id, "--listen", listen)
            assert _same == endpoint
            loop = asyncio.get_running_loop()
            resume_at = loop.time() + A_STOPPED_S
            while loop.time() < resume_at:
                assert a_id in node_b.state.table, "B dropped A while the relay registered it again"
                await asyncio.sleep(0.05)
        finally:
            node_a.process.send_signal(signal.SIGCONT)

        # Until A is registered again and answers B through the relay, B keeps it.
        async def a_answers_b() -> bool:
            assert a_id in node_b.state.table, "B dropped A while the relay registered it again"
            return linked() and await node_b.probe(a_id, timeout=1.0)

        await eventually(a_answers_b, timeout=20)
        assert "dropped peer" not in (tmp_path / "a.log").read_text()
    finally:
        if node_b is not None:
            await node_b.shutdown()
        node_a.stop()
        relay.kill()
        relay.wait(10)


# Shorter than a relay connection's idle timeout (15 s): the nodes must not need it.
WATCH_AFTER_KILL_S = 12.0


async def test_nodes_register_again_at_once_with_a_relay_killed_and_restarted(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    listen = f"127.0.0.1:{free_udp_port()}"
    relay, endpoint = await start_relay_process(tmp_path / "relay", mesh_key.mesh_id, "--listen", listen)
    nodes: list[Node] = []
    try:
        node_a, node_b = await start_relayed_pair(tmp_path, mesh_key, endpoint, nodes)
        assert await node_a.probe(node_b.node_id)

        relay.kill()
        relay.wait(10)
        relay, _same = await start_relay_process(tmp_path / "relay", mesh_key.mesh_id, "--listen", listen)
        assert _same == endpoint
        registrations = {node: client_of(node).registrations for node in nodes}

        loop = asyncio.get_running_loop()
        watch_until = loop.time() + WATCH_AFTER_KILL_S
        while loop.time() < watch_until:
            assert node_b.node_id in node_a.state.table, "A dropped B while the relay came back"
            assert node_a.node_id in node_b.state.table, "B dropped A while the relay came back"
            if all(client_of(node).registrations > registrations[node] for node in nodes) and (
                await node_a.probe(node_b.node_id, timeout=1.0)
            ):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the nodes did not register again before their connections timed out")
        assert await node_b.probe(node_a.node_id)
    finally:
        for node in reversed(nodes):
            await node.shutdown()
        relay.kill()
        relay.wait(10)
