"""A mesh of real ``meshnode`` processes on this machine: what ``meshnode demo`` and ``bench/e2e.py`` run.

Every part is the product's own command in its own process: ``meshnode relay``,
a first node that creates the mesh (``meshnode start`` on a data directory
prepared as ``meshnode create`` would), ``meshnode invite`` for a token, and
``meshnode join`` for every other node (the token passed in the environment,
as the join help recommends). Logs go to ``<work_dir>/<name>.log``; readiness
is read from each node's status socket, never guessed from time.

A process's stdout and stderr share its one log file (one open file, appended
to, so their lines stay in the order written). Everything that explains a
failure is on stderr anyway: the node's log, llama.cpp's messages, the fault
handler's report on a fatal signal; stdout carries the few lines a command
prints for people (ids, addresses), which read best where they happened. So
the log's tail is stderr's but for those; a file of stderr alone would show
the same tail and leave two files to read side by side. A child that dies is
described by its exit signal or code and that tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.openmp_wait import SHORT_SPIN_ENV
from meshnode.app.child_exit import exit_message, read_log_tail
from meshnode.statussocket.client import query_status

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
# Short timers so the nodes see each other within seconds.
FAST_TIMING = ("--heartbeat-interval", "1", "--gossip-timeout", "3", "--probe-timeout", "2")


class LocalMeshError(Exception):
    """A process failed or did not get ready; the message names it and ends with its log."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        # The process the message is about, so a caller does not describe it twice.
        self.child = child


@dataclass
class Child:
    name: str
    log: Path
    process: subprocess.Popen[bytes]
    data_dir: Path | None = None
    # Set when this side stops it: its exit is then expected, not a failure to report.
    stopped: bool = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def died(self) -> bool:
        return not self.stopped and not self.alive()

    def log_tail(self, lines: int = 15) -> str:
        return read_log_tail(self.log, lines)

    def exit_message(self, what: str | None = None) -> str:
        """``B died of SIGSEGV (signal 11) while serving; the end of B.log:`` and its tail."""
        returncode = self.process.poll()
        assert returncode is not None, f"{self.name} is still running"
        return exit_message(self.name, returncode, self.log, what)

    def status(self) -> dict[str, Any] | None:
        if self.data_dir is None:
            return None
        try:
            return query_status(self.data_dir, timeout=2.0)
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        self.stopped = True
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@dataclass(frozen=True)
class RelayInfo:
    relay_id: str
    address: str

    @property
    def endpoint(self) -> str:
        """What ``--relay`` takes."""
        return f"{self.relay_id}@{self.address}"


@dataclass
class LocalMesh:
    work_dir: Path
    model: Path
    threads: int | None = None
    ctx: int | None = None
    timing: Sequence[str] = FAST_TIMING
    # Environment of every process started (on top of this one's).
    # Nodes on one machine share its cores: by default llama.cpp's OpenMP threads spin briefly,
    # then sleep (engines.openmp_wait); callers that know how the nodes fit pass its answer.
    env: dict[str, str] = field(default_factory=lambda: dict(SHORT_SPIN_ENV))
    children: list[Child] = field(default_factory=list)
    mesh_id: str = ""
    relay: RelayInfo | None = None

    # ------------------------------------------------------------------ processes

    def spawn(
        self, name: str, *args: str, env: dict[str, str] | None = None, data_dir: Path | None = None
    ) -> Child:
        log = self.work_dir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "meshnode", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**os.environ, **self.env, **(env or {})},
                # Its own session: a terminal's Ctrl-C reaches the caller, which stops children in order.
                start_new_session=True,
            )
        child = Child(name, log, process, data_dir)
        self.children.append(child)
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def died(self) -> list[Child]:
        """The processes that exited without being stopped from here."""
        return [c for c in self.children if c.died()]

    def stop_all(self) -> None:
        """SIGTERM every process (last started first), then wait; SIGKILL what does not exit."""
        for child in reversed(self.children):
            child.stopped = True
            if child.alive():
                child.process.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            try:
                child.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(5)

    async def until(
        self, child: Child, what: str, check: Callable[[], Any], timeout: float = START_TIMEOUT_S
    ) -> Any:
        """Poll ``check`` (sync or async) until it returns something true; fail if ``child`` or any
        other process of the mesh exits (nothing it waits for can happen without them)."""
        deadline = time.monotonic() + timeout
        while True:
            if not child.alive():
                raise LocalMeshError(child.exit_message(what), child)
            if dead := self.died():
                raise LocalMeshError(dead[0].exit_message(f"{child.name} was {what}"), dead[0])
            result = check()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            if time.monotonic() > deadline:
                raise LocalMeshError(
                    f"{child.name}: timed out {what}; the end of {child.log}:\n{child.log_tail()}"
                )
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ the mesh

    def create_mesh(self, first: str) -> str:
        """What ``meshnode create`` does before it runs the node: a mesh key and the first member's
        certificate. A relay must know the mesh id before the first node registers with it."""
        from meshnode.identity import load_or_create_identity
        from meshnode.membership.credentials import MeshKey, issue_certificate
        from meshnode.membership.store import DataDir, MembershipState

        data_dir = self.work_dir / first
        identity, _ = load_or_create_identity(data_dir)
        mesh_key = MeshKey.generate()
        certificate = issue_certificate(
            mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time(), admin=True
        )
        DataDir(data_dir).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))
        self.mesh_id = mesh_key.mesh_id
        return self.mesh_id

    async def start_relay(self) -> RelayInfo:
        assert self.mesh_id, "create the mesh first"
        relay = self.spawn(
            "relay", "relay", "--data-dir", str(self.work_dir / "relay"), "--listen", "127.0.0.1:0",
            "--mesh", self.mesh_id,
        )  # fmt: skip
        relay_id = await self.until(relay, "starting", lambda: _line(relay.log, "relay id:"))
        address = await self.until(relay, "starting", lambda: _line(relay.log, "relay listening on"))
        self.relay = RelayInfo(relay_id, address)
        return self.relay

    def _node_args(self, layers: tuple[int, int] | None, api: bool, extra: Sequence[str]) -> list[str]:
        args = ["--listen", "127.0.0.1:0", *self.timing, "--model", str(self.model)]
        if layers is not None:
            args += ["--layers", f"{layers[0]}:{layers[1]}"]
        if self.threads:
            args += ["--threads", str(self.threads)]
        if self.ctx:
            args += ["--ctx", str(self.ctx)]
        args += ["--api-listen", "127.0.0.1:0" if api else "off"]
        return [*args, *extra]

    async def start_first(
        self, name: str, layers: tuple[int, int] | None, *, api: bool = True, extra: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The mesh's first node (``create_mesh(name)`` first); registers with the relay if one runs."""
        relay = ["--relay", self.relay.endpoint] if self.relay is not None else []
        data_dir = self.work_dir / name
        child = self.spawn(
            name, "start", "--data-dir", str(data_dir), *self._node_args(layers, api, [*relay, *extra]),
            data_dir=data_dir,
        )  # fmt: skip
        return await self.wait_serving(child)

    def invite(self, issuer: str) -> str:
        """A token from ``meshnode invite`` run against the node ``issuer``."""
        done = subprocess.run(
            [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(self.work_dir / issuer), "--ttl", "30m"],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise LocalMeshError(f"meshnode invite failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def join(
        self,
        name: str,
        layers: tuple[int, int] | None,
        token: str,
        *,
        behind_nat: bool = False,
        api: bool = False,
        extra: Sequence[str] = (),
    ) -> Child:
        """Start ``meshnode join`` (wait with :meth:`wait_serving`). ``behind_nat``: never dialed nor
        dialing directly, only reachable through the relay."""
        nat = ["--relay-only", "--not-directly-reachable"] if behind_nat else []
        data_dir = self.work_dir / name
        return self.spawn(
            name, "join", "--data-dir", str(data_dir), *self._node_args(layers, api, [*nat, *extra]),
            env={"MESHNODE_INVITE": token}, data_dir=data_dir,
        )  # fmt: skip

    async def wait_serving(self, child: Child) -> dict[str, Any]:
        def serving() -> dict[str, Any] | None:
            status = child.status()
            if status is None or status["node"]["serving"] is None or not status["node"]["member"]:
                return None
            return status

        return dict(await self.until(child, "loading its layers and joining", serving))

    async def wait_route(self, api_node: str) -> tuple[str, list[str]]:
        """Until every running node sees every other one and ``api_node``'s API lists a model:
        its API URL and the models listed."""
        from meshnode.head.api_client import ApiError, served_models

        nodes = [c for c in self.children if c.data_dir is not None and c.alive()]
        first = self.child(api_node)

        def all_see_each_other() -> bool:
            statuses = [c.status() for c in nodes]
            if any(s is None for s in statuses):
                return False
            ids = {s["node"]["id"] for s in statuses if s is not None}
            return all(
                ids - {s["node"]["id"]} <= {p["id"] for p in s["peers"] if p["serving"]}
                for s in statuses
                if s is not None
            )

        await self.until(first, "waiting for the nodes to see each other", all_see_each_other)
        status = first.status()
        assert status is not None
        api = str(status["node"]["api_url"])

        async def listed() -> list[str] | None:
            try:
                return await served_models(api) or None
            except ApiError:
                return None

        models = await self.until(first, "waiting for a complete route", listed)
        return api, list(models)


def _line(log: Path, prefix: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
    return None


__all__ = ["FAST_TIMING", "Child", "LocalMesh", "LocalMeshError", "RelayInfo"]
