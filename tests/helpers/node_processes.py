"""Real ``meshnode`` processes for tests: one node (``NodeProcess``) or a mesh of shard servers (``QuicCluster``).

``QuicCluster`` starts ``meshnode`` processes on one model in one mesh over real QUIC:
the first is created as a member, the others join with its invites, each with the
options ``node_args`` names for it. A test process joins the same mesh as a client node
(``client_node``) to reach them with ``Node.get_link``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from helpers.mesh_nodes import cluster_client_config, invite_to, new_membership, start_invited_node
from helpers.tiny_llama import CTX, THREADS
from meshnode.app.child_exit import exit_message
from meshnode.identity import NodeIdentity, load_identity, write_private_file
from meshnode.membership.credentials import Invite, MeshKey, decode_invite_token, encode_invite_token
from meshnode.membership.store import DataDir
from meshnode.node import Node
from meshnode.statussocket.client import query_status

START_TIMEOUT_S = 60.0
NODE_TIMING = ["--heartbeat-interval", "0.3", "--gossip-timeout", "2", "--probe-timeout", "2"]


class NodeProcess:
    """``meshnode COMMAND --data-dir ROOT/NAME ...``, logging to ``ROOT/NAME.log``."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.data_dir = root / name
        self.log_path = root / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self, command: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "meshnode", command, "--data-dir", str(self.data_dir), *args]

    def start(
        self, command: str, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        """Start the process; ``stdin``, if given, is its first line of input (then end of input)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(command, *args),
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                stdout=log,
                stderr=log,
                env=env,
            )
        if stdin is not None:
            assert self.process.stdin is not None
            self.process.stdin.write(stdin.encode() + b"\n")
            self.process.stdin.close()

    def status(self) -> dict | None:
        """What the node's status socket says; None while it does not answer."""
        try:
            return query_status(self.data_dir, timeout=2.0)
        except (OSError, ValueError):
            return None

    def live_status(self) -> dict | None:
        """``status()`` of a process that must still be running: fails at once if it has exited."""
        assert self.process is not None, f"{self.name} was never started"
        if self.process.poll() is not None:
            raise AssertionError(self.exit_message("starting"))
        return self.status()

    def wait_ready(self) -> dict:
        """Block until the node serves its shard; its status then."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            status = self.live_status()
            if status is not None and status["node"]["serving"] is not None:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not serving:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def node_id(self) -> bytes:
        status = self.status()
        assert status is not None, f"{self.name} does not answer status"
        return bytes.fromhex(status["node"]["id"])

    def api_url(self) -> str:
        status = self.status()
        assert status is not None and status["node"]["api_url"], f"{self.name} serves no API"
        return str(status["node"]["api_url"])

    def invite(self) -> Invite:
        """An invite into this member's mesh from it (the mesh key is read from its data directory)."""
        node_id = load_identity(self.data_dir).node_id
        membership = DataDir(self.data_dir).load_membership(node_id)
        status = self.live_status()
        assert status is not None, f"{self.name} does not answer status"
        return invite_to(membership.mesh_key, node_id, status["node"]["addresses"][0])

    def exit_message(self, what: str | None = None) -> str:
        """``B died of SIGSEGV (signal 11) while starting; the end of B.log:`` and its tail."""
        assert self.process is not None and self.process.returncode is not None
        return exit_message(self.name, self.process.returncode, self.log_path, what)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def write_member(data_dir: Path, mesh_key: MeshKey) -> NodeIdentity:
    """A new node identity in ``data_dir``, a member of ``mesh_key``'s mesh holding its key."""
    identity = NodeIdentity.generate()
    write_private_file(data_dir / "node_key.pem", identity.to_pem())
    DataDir(data_dir).save_membership(new_membership(mesh_key, identity))
    return identity


def api_node_args(names: Iterable[str], with_api: Iterable[str], *extra: str) -> dict[str, list[str]]:
    """``QuicCluster`` node options: the API on a free loopback port for ``with_api``, none for
    the other ``names``; ``extra`` options for all of them."""
    served = set(with_api)
    return {name: ["--api-listen", "127.0.0.1:0" if name in served else "off", *extra] for name in names}


class QuicCluster:
    """Shard processes in one mesh; the first is created as a member, the others join with invites."""

    def __init__(
        self,
        root: Path,
        model: Path,
        node_args: Mapping[str, Sequence[str]] | None = None,
        process_for: Callable[[Path, str], NodeProcess] = NodeProcess,
    ) -> None:
        self.root = root
        self.model = model
        self.node_args = dict(node_args or {})
        self.process_for = process_for
        self.mesh_key = MeshKey.generate()
        self.processes: list[NodeProcess] = []
        self.first_id = b""
        self.first_address = ""

    def serve_args(self, name: str, start: int, end: int) -> list[str]:
        """The options node ``name`` serves layers ``[start, end)`` of the model with."""
        return [
            "--listen",
            "127.0.0.1:0",
            *NODE_TIMING,
            "--model",
            str(self.model),
            "--layers",
            f"{start}:{end}",
            "--threads",
            str(THREADS),
            "--ctx",
            str(CTX),
            "--log-level",
            "debug",
            *self.node_args.get(name, ()),
        ]

    def invite(self) -> str:
        return encode_invite_token(invite_to(self.mesh_key, self.first_id, self.first_address))

    def start_shard(self, name: str, start: int, end: int) -> NodeProcess:
        """Start node ``name`` serving ``[start, end)`` and wait until it serves."""
        process = self.process_for(self.root, name)
        if not self.processes:
            self.first_id = write_member(process.data_dir, self.mesh_key).node_id
            process.start("start", *self.serve_args(name, start, end))
        else:
            process.start("join", "--invite", self.invite(), *self.serve_args(name, start, end))
        self.processes.append(process)
        status = process.wait_ready()
        if len(self.processes) == 1:
            self.first_address = status["node"]["addresses"][0]
        return process

    @contextlib.contextmanager
    def running(self, splits: Mapping[str, tuple[int, int]]) -> Iterator[QuicCluster]:
        """The cluster with a node per name of ``splits`` serving its layers; stopped afterwards."""
        try:
            for name, (start, end) in splits.items():
                self.start_shard(name, start, end)
            yield self
        finally:
            self.stop()

    def named(self, name: str) -> NodeProcess:
        (process,) = [p for p in self.processes if p.name == name]
        return process

    async def client_node(self, data_dir: Path) -> Node:
        """A node of this test process, joined to the cluster's mesh (serving nothing)."""
        return await start_invited_node(data_dir, cluster_client_config(), decode_invite_token(self.invite()))

    def stop(self) -> None:
        for process in self.processes:
            process.stop()

    def logs(self) -> str:
        return "".join(p.log_path.read_text() for p in self.processes if p.log_path.exists())

    def log_tails(self, chars: int = 3000) -> str:
        """The end of each node's log under its name, for a failing assertion's message."""
        return "\n".join(
            f"--- {p.name}.log:\n{p.log_path.read_text()[-chars:]}"
            for p in self.processes
            if p.log_path.exists()
        )


__all__ = [
    "NODE_TIMING",
    "START_TIMEOUT_S",
    "NodeProcess",
    "QuicCluster",
    "api_node_args",
    "write_member",
]
