"""Acceptance: four real `meshnode` processes on loopback.

The first creates the mesh, the others join with an invite; every node lists the
other three; SIGKILL makes the others drop the node after probing; SIGTERM makes
them drop it at once via PeerLeaving; the killed node restarts and rejoins. All
logs are captured at debug level and must never contain the invite secret or the
mesh key.
"""

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.node_processes import NodeProcess
from helpers.polling import wait_until

from meshnode.identity import private_key_seed
from meshnode.membership.credentials import decode_invite_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIMING = [
    "--listen",
    "127.0.0.1:0",
    "--heartbeat-interval",
    "0.3",
    "--gossip-timeout",
    "2",
    "--probe-timeout",
    "2",
    "--log-level",
    "debug",
]
DEADLINE_S = 20.0


class CliNodeProcess(NodeProcess):
    """A node process started with the test's timing. Polled on its status socket (what ``meshnode
    status`` reads; a ``meshnode status`` process per poll of four nodes spent most of this test
    starting interpreters), and asked once with ``meshnode status --json`` at the end."""

    def __init__(self, root: Path, name: str) -> None:
        super().__init__(root, name)
        self.short_id = ""

    def command(self, command: str, *args: str) -> list[str]:
        return super().command(command, *TIMING, *args)

    def status(self) -> dict | None:
        status = super().status()
        if status is not None:
            self.short_id = status["node"]["short_id"]
        return status

    def cli_status(self) -> dict | None:
        result = subprocess.run(
            [sys.executable, "-m", "meshnode", "status", "--json", "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            return None
        status = json.loads(result.stdout)
        self.short_id = status["node"]["short_id"]
        return status

    def peers(self) -> set[str]:
        status = self.status()
        return {p["short_id"] for p in status["peers"]} if status else set()

    def log(self) -> str:
        return self.log_path.read_text()


def secret_encodings(secret: bytes) -> list[str]:
    return [
        secret.hex(),
        repr(secret),
        base64.b64encode(secret).decode().rstrip("="),
        base64.urlsafe_b64encode(secret).decode().rstrip("="),
    ]


def test_four_processes_form_a_mesh_drop_failed_nodes_and_rejoin(tmp_path):
    nodes = {name: CliNodeProcess(tmp_path, name) for name in ("n1", "n2", "n3", "n4")}
    n1, n2, n3, n4 = nodes.values()
    try:
        n1.start("create")
        wait_until(lambda: n1.status() is not None, DEADLINE_S, "n1 serves its status")
        invite = subprocess.run(
            [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(n1.data_dir)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        token = invite.stdout.strip()
        # The three ways to hand over the secret: stdin, environment, argument.
        n2.start("join", "--invite", "-", stdin=token)
        n3.start("join", env={**os.environ, "MESHNODE_INVITE": token})
        n4.start("join", "--invite", token)

        def full_mesh(members):
            views = {node.name: node.peers() for node in members}
            ids = {node.name: node.short_id for node in members}
            return all(views[n.name] == {ids[m.name] for m in members if m is not n} for n in members)

        wait_until(lambda: full_mesh([n1, n2, n3, n4]), DEADLINE_S, "every node lists the other three")
        ids = {node.name: node.short_id for node in nodes.values()}

        # SIGKILL: no goodbye; the others notice, probe, and drop it.
        n4.process.send_signal(signal.SIGKILL)
        n4.process.wait(10)
        wait_until(
            lambda: all(ids["n4"] not in node.peers() for node in (n1, n2, n3)), DEADLINE_S, "n4 dropped"
        )
        assert any(f"dropped peer {ids['n4']}: unreachable, probe failed" in n.log() for n in (n1, n2, n3))

        # SIGTERM: PeerLeaving, dropped by everyone without probing.
        n3.stop()
        assert n3.process.returncode == 0
        wait_until(lambda: all(ids["n3"] not in node.peers() for node in (n1, n2)), 5, "n3 dropped")
        for node in (n1, n2):
            drops = [line for line in node.log().splitlines() if f"dropped peer {ids['n3']}:" in line]
            assert drops and drops[-1].endswith("left the mesh"), drops

        # The killed node restarts from its data directory and rejoins.
        n4.start("start")
        wait_until(lambda: full_mesh([n1, n2, n4]), DEADLINE_S, "n4 rejoined")

        # The CLI says what the socket says.
        cli = n1.cli_status()
        assert cli is not None and cli["node"]["short_id"] == ids["n1"]
        assert {p["short_id"] for p in cli["peers"]} == {ids["n2"], ids["n4"]}

        logs = "".join(node.log() for node in nodes.values())
        assert "admitted peer" in logs and "joined mesh" in logs
        invite_secret = private_key_seed(decode_invite_token(token).invite_key)
        mesh_secret = (n1.data_dir / "mesh_key").read_bytes()
        for secret in (invite_secret, mesh_secret):
            for encoding in secret_encodings(secret):
                assert encoding not in logs
        assert token not in logs and token[:40] not in logs
    finally:
        for node in nodes.values():
            node.stop()
