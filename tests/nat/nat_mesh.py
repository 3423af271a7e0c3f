"""Processes of a NAT-lab scenario: relay, nodes, their logs and status (shared by the NAT tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.polling import wait_until
from netns import SERVICE_ADDRESS, NatLab

from meshnode.statussocket.client import query_status

NODE_PORT = 7447
RELAY_PORT = 7448
# Node options that keep every hop between homes on the relay (the tests of relayed links).
RELAYED_ONLY = ("--hole-punching", "off")


class Mesh:
    """The processes of one scenario and their logs (shown when something fails)."""

    def __init__(self, lab: NatLab, root: Path) -> None:
        self.lab = lab
        self.root = root
        self.logs: dict[str, Path] = {}
        self.relay: subprocess.Popen[bytes] | None = None
        self.mesh_id = ""

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def spawn(
        self, name: str, role: str, argv: list[str], stdin: str | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        process = self.lab.spawn(role, argv, log=log, stdin=subprocess.PIPE if stdin is not None else None)
        if stdin is not None:
            assert process.stdin is not None
            process.stdin.write(stdin.encode() + b"\n")
            process.stdin.close()
        return process

    def start_relay(self, mesh_id: str) -> None:
        name = f"relay-{sum(1 for n in self.logs if n.startswith('relay'))}"
        self.relay = self.spawn(
            name,
            "pub",
            [
                sys.executable,
                "-m",
                "relay",
                "--listen",
                f"{SERVICE_ADDRESS}:{RELAY_PORT}",
                "--mesh",
                mesh_id,
                "--data-dir",
                str(self.dir("r")),
                "--keepalive",
                "5",
            ],
        )
        wait_until(lambda: b"relay listening" in self.logs[name].read_bytes(), 20, "the relay to listen")

    def status(self, name: str) -> dict | None:
        try:
            return query_status(self.root / name, timeout=2.0)
        except OSError:
            return None

    def dump(self) -> str:
        return "\n".join(
            f"--- {name} ---\n{log.read_text(errors='replace')[-4000:]}" for name, log in self.logs.items()
        )


def node_args(command: str, data_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshnode",
        command,
        "--data-dir",
        str(data_dir),
        "--listen",
        f"0.0.0.0:{NODE_PORT}",
        "--not-directly-reachable",
        "--heartbeat-interval",
        "0.5",
        "--log-level",
        "debug",
        *extra,
    ]


def peers_of(status: dict | None) -> dict[str, dict]:
    return {peer["id"]: peer for peer in (status or {}).get("peers", [])}


def relay_registered(status: dict | None) -> bool:
    relays = (status or {}).get("node", {}).get("relays", [])
    return bool(relays) and all(relay["registered"] for relay in relays)
