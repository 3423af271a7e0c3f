"""``meshnode status --data-dir RELAY_DIR``: a running relay answers on its data directory's socket."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.polling import eventually
from relay_helpers import new_member

from meshnode.app.status import format_status
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.membership.store import CONTROL_SOCKET
from meshnode.relaylink.client import RelayDialer
from relay.server import RelayServer
from relay.status import relay_status

pytestmark = pytest.mark.timeout(60)


async def test_the_status_names_registered_members_and_counts_what_was_forwarded_and_refused() -> None:
    mesh_key = MeshKey.generate()
    server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id}, flush_timeout=0.3)
    await server.start("127.0.0.1", 0)
    dialers: list[RelayDialer] = []
    try:
        endpoint = Endpoint(server.relay_id, f"127.0.0.1:{server.address[1]}")
        members = [new_member(mesh_key) for _ in range(2)]
        sessions = []
        for member in members:
            dialer = await RelayDialer.open(member.identity, None, host="127.0.0.1")
            dialers.append(dialer)
            sessions.append(await dialer.register(endpoint, mesh_id=member.mesh_id, proof=member.proof))
        await sessions[0].send(members[1].node_id, 9, b"sealed")
        await sessions[0].send(NodeIdentity.generate().node_id, 9, b"sealed")  # nobody: refused
        await eventually(lambda: server.core.stats.frames_forwarded >= 1 and server.core.stats.refused_frames)

        status = relay_status(server, started=0.0, metrics_url=None).to_json()
        shown = status["relay"]
        assert shown["id"] == server.relay_id.hex() and shown["meshes"] == [mesh_key.mesh_id]
        assert sorted(m["short_id"] for m in shown["members"]) == sorted(short_id(m.node_id) for m in members)
        assert {m["mesh_id"] for m in shown["members"]} == {mesh_key.mesh_id}
        assert all(m["address"].startswith("127.0.0.1:") for m in shown["members"])
        assert shown["frames_refused"] == {"RELAY_ERROR_DESTINATION_UNKNOWN": 1}
        assert shown["frames_forwarded"] >= 1 and shown["connections"] == 2

        lines = format_status(status).splitlines()
        assert lines[0].startswith(
            f"relay {short_id(server.relay_id)}  listening on 127.0.0.1:{server.address[1]}"
        )
        assert lines[1] == f"  meshes: {mesh_key.mesh_id}"
        assert lines[2] == "  connections 2 (0 not registered); 2 registrations since start"
        assert "  frames refused: DESTINATION_UNKNOWN 1" in lines
        members_at = lines.index("members registered (2):")
        assert sorted(line.split()[0] for line in lines[members_at + 1 :]) == sorted(
            short_id(m.node_id) for m in members
        )
        assert all("  from 127.0.0.1:" in line for line in lines[members_at + 1 :])
    finally:
        await server.close(flush_timeout=0.3)
        for dialer in dialers:
            dialer.close()
        await asyncio.sleep(0.01)


@pytest.mark.slow
def test_meshnode_status_asks_a_running_relay_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--mesh", "a" * 26]
    process = subprocess.Popen(
        [*command, "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        relay_id = process.stdout.readline().removeprefix("relay id: ").strip()
        listening = process.stdout.readline().removeprefix("relay listening on ").strip()
        shown = subprocess.run(
            [sys.executable, "-m", "meshnode", "status", "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].startswith(
            f"relay {short_id(bytes.fromhex(relay_id))}  listening on {listening}  up "
        )
        assert lines[-1] == "members registered (0):"
        process.terminate()
        assert process.wait(timeout=10) == 0
        assert not (tmp_path / CONTROL_SOCKET).exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
