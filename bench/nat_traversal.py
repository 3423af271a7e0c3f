"""NAT traversal in the network-namespace lab: how often and how fast members behind NAT go direct,
what the relay still carries once they have, and the round trip either way (root only).

    sudo .venv/bin/python bench/nat_traversal.py [--pairs 20] [--presets home,symmetric,same-lan,home-lossy]
                                                 [--delay-ms 25] [--parts success,bytes,rtt]

Real ``meshnode`` processes in ``tests/nat/netns.py``'s lab, each home behind a router as the
preset sets it up (``home``: endpoint-independent mapping, port-dependent filtering;
``symmetric``: a port per destination; ``same-lan``: two homes behind one router;
``home-lossy``: ``home`` with 5 % of the UDP each router forwards dropped).

1. success: per preset, ``--pairs`` fresh pairs (new data dirs, new identities, new processes; one
   lab and one relay identity per preset, the relay restarted for each pair's new mesh). A in
   ``ha`` creates the mesh registered with the relay in ``pub``, B in ``hb`` joins with A's invite,
   both ``--not-directly-reachable --heartbeat-interval 0.5``, every other option the default
   (the first punch backoff too: 60 s). ``same-lan``: B in ``ha2``, and a creator C on the public
   side whose invite both join, so A and B meet through gossip (A's own invite would let B dial
   A's private address at once). Time to direct: from the first poll (every 0.1 s) in which both
   list each other as peers to the first in which both show ``path`` punched or lan for each
   other; a pair not direct within ``--pair-timeout`` (30 s) failed. ``symmetric`` is watched for
   ``--symmetric-window`` (15 s) only: no pair can punch there. Prints the success rate, the time
   to direct's p50 and p95 (nearest rank, successes only) and the punch attempts both sides
   counted (``meshnode status``: ``sections.traversal.punch_attempts``).
2. bytes: the relay's ``bytes_forwarded`` over one 64-token greedy generation (A's API in ``ha``,
   ``POST /v1/completions``, default speculation) with Gemma 3 270M split in two, A (``ha``)
   layers 0:9, B (``hb``) 9:18, ``--punch-backoff 2``: first with the homes cut from each other
   (``NatLab.cut_between_homes``: punching fails, the A<->B hop is relayed), then, after
   ``join_homes`` and both sides showing punched, and 4 s for the relayed link to drain and
   close, the same generation again. Prints both, the ratio (target: under 5 %) and whether
   the two texts are identical.
3. rtt: the relay moves to the lab's far host, behind a wire that holds every packet
   ``--delay-ms`` each way (``tests/nat/delay_wire.py``: two TUN devices, packets unchanged, so
   the relay still sees each home router's own mapping). C (public side) creates the mesh, B
   (``hb``, a ``meshnode`` process) and A (``ha``, this file run as ``probe-client``: an
   in-process node) join it. With the homes cut, A times ``--round-trips`` round trips to B over
   the relayed link; then the homes are joined, A waits for its punched path to B and times as
   many over it. The figure: a PROBE request and B's echo on A's live link (a new stream, one
   small frame each way: the message of the node's liveness probe); beside it, alternating, the
   node's own ``probe()``, which asks ``get_link`` for the link first. Every sample's link path
   is checked before and after. Prints median and p90 of each and the relayed / punched ratio,
   with a UDP echo over the wire (home A to the far host) as the wire's own round trip.

Every namespace and process goes in ``NatLab.down()`` (also on Ctrl-C and SIGTERM). The work
directory (data dirs, logs) is removed at the end unless a pair failed unexpectedly or
``--keep`` is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and `bench/relay.py` would shadow
# the `relay` package; the NAT lab and the shared test helpers live under tests/.
_BENCH = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _BENCH]
sys.path[:0] = [str(_BENCH.parent / "tests" / "nat"), str(_BENCH.parent / "tests")]
# ruff: noqa: E402

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from nat_mesh import NODE_PORT, RELAY_PORT, node_args, peers_of, relay_registered
from netns import (
    FAR_ADDRESS,
    PRESETS,
    SERVICE_ADDRESS,
    NatLab,
    sweep_stale,
    unavailable_reason,
)

from meshnode.statussocket.client import query_status

DIRECT = ("punched", "lan")
PARTS = ("success", "bytes", "rtt")
PROBE_PORT = 7449
API_PORT = 8080
MAX_TOKENS = 64
PROMPT = "The history of the lighthouse begins in the ancient world, where"
# A pair that failed to punch waits this long before its next round (parts 2 and 3 only).
BACKOFF_S = 2.0
# After both sides show the punched path: the relayed link drains 2 s, then closes.
DRAIN_S = 4.0
SCRIPT = Path(__file__).resolve()


class BenchFailure(RuntimeError):
    """The scenario could not be set up (not a measured failure)."""


# -- small helpers ---------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least ``p`` % of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def status_of(data_dir: Path) -> dict[str, Any] | None:
    try:
        return query_status(data_dir, timeout=2.0)
    except (OSError, ValueError):
        return None


def mesh_id_of(data_dir: Path) -> str:
    """The mesh id of a node that serves (the caller waited for it), so it answers its status."""
    status = status_of(data_dir)
    assert status is not None, f"{data_dir} does not answer its status"
    return str(status["node"]["mesh_id"])


def node_id(data_dir: Path) -> str | None:
    return ((status_of(data_dir) or {}).get("node") or {}).get("id")


def peer_entry(status: dict[str, Any] | None, other: str) -> dict[str, Any]:
    return peers_of(status).get(other) or {}


def punch_attempts(status: dict[str, Any] | None) -> dict[str, int]:
    sections = (status or {}).get("sections") or {}
    return dict((sections.get("traversal") or {}).get("punch_attempts") or {})


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, *, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise BenchFailure(f"not within {timeout:g} s: {what}")
        time.sleep(interval)
    return value


def log_lines(log: Path, *needles: str, last: int = 8) -> list[str]:
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [line for line in lines if any(n in line for n in needles)][-last:]


class Scenario:
    """One set of processes in a lab, its data dirs and logs under ``root``; ``stop`` ends them."""

    def __init__(self, lab: NatLab, root: Path) -> None:
        self.lab = lab
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def spawn(
        self, name: str, role: str, argv: list[str], stdin: str | None = None
    ) -> subprocess.Popen[bytes]:
        process = self.lab.spawn(
            role, argv, log=self.log(name), stdin=subprocess.PIPE if stdin is not None else None
        )
        if stdin is not None:
            assert process.stdin is not None
            process.stdin.write(stdin.encode() + b"\n")
            process.stdin.close()
        self.processes[name] = process
        return process

    def alive(self, name: str) -> None:
        """Raise when the process has exited (what it logged last says why); ``None`` (falsy) while it
        runs, so a wait's predicate reads ``scenario.alive(name) or <condition>``."""
        process = self.processes[name]
        if process.poll() is not None:
            tail = self.log(name).read_text(errors="replace")[-3000:]
            raise BenchFailure(f"{name} exited with {process.returncode}:\n{tail}")

    def invite(self, role: str, creator: Path) -> str:
        made = self.lab.run(role, [sys.executable, "-m", "meshnode", "invite", "--data-dir", str(creator)])
        if made.returncode != 0:
            raise BenchFailure(f"meshnode invite failed: {made.stderr}")
        return made.stdout.strip()

    def start_relay(self, role: str, address: str, relay_dir: Path, mesh_id: str) -> None:
        argv = [
            sys.executable, "-m", "relay", "--listen", f"{address}:{RELAY_PORT}", "--mesh", mesh_id,
            "--data-dir", str(relay_dir), "--keepalive", "5",
        ]  # fmt: skip
        self.spawn("relay", role, argv)
        wait_for(
            lambda: self.alive("relay") or b"relay listening" in self.log("relay").read_bytes(),
            20,
            "the relay to listen",
        )

    def start_node(self, name: str, role: str, argv: list[str], stdin: str | None = None) -> str:
        """Start a node and wait for its status socket; its id."""
        self.spawn(name, role, argv, stdin)
        return str(wait_for(lambda: self.alive(name) or node_id(self.dir(name)), 60, f"{name} to start"))

    def stop(self) -> None:
        """SIGTERM to all at once (they leave the mesh in parallel), SIGKILL what outlives 10 s."""
        running = [p for p in self.processes.values() if p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def relay_id_of(lab: NatLab, role: str, relay_dir: Path) -> str:
    shown = lab.run(role, [sys.executable, "-m", "relay", "--show-id", "--data-dir", str(relay_dir)])
    if shown.returncode != 0:
        raise BenchFailure(f"relay --show-id failed: {shown.stderr}")
    return shown.stdout.strip()


def public_creator(scenario: Scenario, relay_arg: str, *extra: str) -> list[str]:
    """``meshnode create`` for C on the public side: directly reachable at the service address."""
    argv = node_args(
        "create",
        scenario.dir("c"),
        "--relay",
        relay_arg,
        "--advertise",
        f"{SERVICE_ADDRESS}:{NODE_PORT}",
        *extra,
    )
    argv.remove("--not-directly-reachable")
    return argv


@contextlib.contextmanager
def lab_up(preset: str) -> Iterator[NatLab]:
    lab = NatLab(preset=preset)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


# -- 1. success --------------------------------------------------------------------------------------


@dataclasses.dataclass
class PairResult:
    index: int
    met_s: float | None  # from B's start until both list each other
    direct_s: float | None  # from then until both show a direct path (None: not within the window)
    paths: tuple[str | None, str | None]
    attempts: Counter[str]
    failure: str = ""


@dataclasses.dataclass
class PresetResult:
    preset: str
    window_s: float
    pairs: list[PairResult]

    @property
    def successes(self) -> list[float]:
        return [p.direct_s for p in self.pairs if p.direct_s is not None]

    @property
    def attempts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for pair in self.pairs:
            total.update(pair.attempts)
        return total

    def line(self) -> str:
        done = self.successes
        timing = (
            f"p50 {percentile(done, 50):.2f} s, p95 {percentile(done, 95):.2f} s"
            if done
            else "no direct path"
        )
        attempts = ", ".join(f"{k} {n}" for k, n in sorted(self.attempts.items())) or "none"
        return (
            f"{self.preset}: {len(done)}/{len(self.pairs)} direct within {self.window_s:g} s; {timing}; "
            f"punch attempts (both sides, all pairs): {attempts}"
        )


def run_pair(
    lab: NatLab, root: Path, relay_dir: Path, relay_arg: str, index: int, window_s: float
) -> PairResult:
    scenario = Scenario(lab, root)
    same_lan = lab.preset == "same-lan"
    try:
        if same_lan:
            # C creates; A and B, behind one router, both join C's mesh and meet through gossip.
            scenario.start_node("c", "pub", public_creator(scenario, relay_arg))
            creator, creator_role = scenario.dir("c"), "pub"
        else:
            scenario.start_node("a", "ha", node_args("create", scenario.dir("a"), "--relay", relay_arg))
            creator, creator_role = scenario.dir("a"), "ha"
        mesh_id = str((status_of(creator) or {}).get("node", {}).get("mesh_id"))
        scenario.start_relay("pub", SERVICE_ADDRESS, relay_dir, mesh_id)
        wait_for(lambda: relay_registered(status_of(creator)), 30, "the creator to register with the relay")
        b_role = "ha2" if same_lan else "hb"
        joiners = [("a", "ha"), ("b", b_role)] if same_lan else [("b", b_role)]
        invites = {name: scenario.invite(creator_role, creator) for name, _ in joiners}
        started = time.monotonic()
        for name, role in joiners:
            scenario.spawn(
                name, role, node_args("join", scenario.dir(name), "--invite", "-"), stdin=invites[name]
            )
        ids = {
            name: str(wait_for(lambda n=name: scenario.alive(n) or node_id(scenario.dir(n)), 60, name))
            for name in ("a", "b")
        }
        met_at: float | None = None
        direct_at: float | None = None
        status_a = status_b = None
        while True:
            status_a, status_b = status_of(scenario.dir("a")), status_of(scenario.dir("b"))
            now = time.monotonic()
            to_b, to_a = peer_entry(status_a, ids["b"]), peer_entry(status_b, ids["a"])
            if met_at is None and to_b and to_a:
                met_at = now
            if met_at is not None:
                if to_b.get("path") in DIRECT and to_a.get("path") in DIRECT:
                    direct_at = now
                    break
                if now - met_at > window_s:
                    break
            elif now - started > 60:
                raise BenchFailure("A and B did not list each other within 60 s")
            time.sleep(0.1)
        paths = (peer_entry(status_a, ids["b"]).get("path"), peer_entry(status_b, ids["a"]).get("path"))
        # A punch's outcome is counted just after its link takes over: ask again a moment later.
        time.sleep(1.0)
        attempts = Counter(punch_attempts(status_of(scenario.dir("a")))) + Counter(
            punch_attempts(status_of(scenario.dir("b")))
        )
        return PairResult(
            index,
            met_s=met_at - started,
            direct_s=direct_at - met_at if direct_at is not None else None,
            paths=paths,
            attempts=attempts,
        )
    except BenchFailure as exc:
        return PairResult(index, None, None, (None, None), Counter(), failure=str(exc))
    finally:
        scenario.stop()


def success_part(args: argparse.Namespace, work: Path) -> list[PresetResult]:
    results = []
    for preset in args.presets:
        window = args.symmetric_window if preset == "symmetric" else args.pair_timeout
        print(
            f"\n== success: {preset}, {args.pairs} fresh pairs, watched {window:g} s each after they meet =="
        )
        with lab_up(preset) as lab:
            relay_dir = work / preset / "relay"
            relay_dir.mkdir(parents=True, exist_ok=True)
            relay_arg = f"{relay_id_of(lab, 'pub', relay_dir)}@{SERVICE_ADDRESS}:{RELAY_PORT}"
            result = PresetResult(preset, window, [])
            for index in range(args.pairs):
                root = work / preset / f"pair{index:02d}"
                pair = run_pair(lab, root, relay_dir, relay_arg, index, window)
                result.pairs.append(pair)
                report_pair(preset, args.pairs, pair, root)
            results.append(result)
        print(result.line())
    return results


def report_pair(preset: str, total: int, pair: PairResult, root: Path) -> None:
    head = f"  {preset} pair {pair.index + 1}/{total}:"
    if pair.failure:
        print(f"{head} SETUP FAILED: {pair.failure.splitlines()[0]} (logs in {root})")
        return
    attempts = dict(sorted(pair.attempts.items()))
    if pair.direct_s is not None:
        print(
            f"{head} met {pair.met_s:.1f} s after B started, direct {pair.direct_s:.2f} s later {pair.paths} {attempts}"
        )
        return
    print(f"{head} met {pair.met_s:.1f} s after B started, NOT direct: paths {pair.paths} {attempts}")
    if preset != "symmetric":
        # Unexpected: show why, from both nodes' own words.
        for name in ("a", "b"):
            for line in log_lines(root / f"{name}.log", "punch", "hole", "direct path", "shortcut"):
                print(f"    {name}: {line[:300]}")
        print(f"    logs in {root}")


# -- 2. bytes ----------------------------------------------------------------------------------------


GENERATE = """
import json, sys, time, urllib.request
body = json.dumps({"prompt": sys.argv[1], "max_tokens": int(sys.argv[2]), "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[3], body, {"Content-Type": "application/json"})
started = time.perf_counter()
with urllib.request.urlopen(request, timeout=600) as response:
    answer = json.load(response)
print(json.dumps({"seconds": time.perf_counter() - started, "text": answer["choices"][0]["text"],
                  "finish_reason": answer["choices"][0]["finish_reason"], "usage": answer.get("usage")}))
"""


def generate(lab: NatLab, max_tokens: int) -> dict[str, Any]:
    """One greedy completion through A's API, asked from inside A's home."""
    url = f"http://127.0.0.1:{API_PORT}/v1/completions"
    done = lab.run("ha", [sys.executable, "-c", GENERATE, PROMPT, str(max_tokens), url], timeout=600)
    if done.returncode != 0:
        raise BenchFailure(f"the generation failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout))


def relay_forwarded(relay_dir: Path) -> int:
    status = status_of(relay_dir)
    if status is None or "relay" not in status:
        raise BenchFailure("the relay's status socket does not answer")
    return int(status["relay"]["bytes_forwarded"])


@dataclasses.dataclass
class Generation:
    label: str
    paths: tuple[str | None, str | None]
    relay_bytes: int  # the relay's bytes_forwarded over the generation
    a_relay_bytes: int  # A's relay_bytes for B over it
    seconds: float
    tokens: int
    text: str


def bytes_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from engines.default_model import default_model_path

    model = default_model_path(progress=False)
    print(
        f"\n== bytes: Gemma 3 270M (A ha 0:9, B hb 9:18), {MAX_TOKENS} tokens greedy, relayed then punched =="
    )
    with lab_up("home") as lab:
        scenario = Scenario(lab, work / "bytes")
        try:
            return measure_bytes(lab, scenario, model)
        finally:
            scenario.stop()


def shard(model: Path, layers: str) -> list[str]:
    return ["--model", str(model), "--layers", layers, "--threads", "1", "--ctx", "1024"]


def measure_bytes(lab: NatLab, scenario: Scenario, model: Path) -> dict[str, Any]:
    relay_dir = scenario.dir("r")
    relay_arg = f"{relay_id_of(lab, 'pub', relay_dir)}@{SERVICE_ADDRESS}:{RELAY_PORT}"
    lab.cut_between_homes()
    backoff = ("--punch-backoff", f"{BACKOFF_S:g}")
    a, b = scenario.dir("a"), scenario.dir("b")
    id_a = scenario.start_node(
        "a",
        "ha",
        node_args(
            "create",
            a,
            "--relay",
            relay_arg,
            *shard(model, "0:9"),
            "--api-listen",
            f"0.0.0.0:{API_PORT}",
            *backoff,
        ),
    )
    wait_for(
        lambda: scenario.alive("a") or ((status_of(a) or {}).get("node") or {}).get("serving"),
        120,
        "A to serve",
    )
    scenario.start_relay("pub", SERVICE_ADDRESS, scenario.dir("r"), mesh_id_of(a))
    wait_for(lambda: relay_registered(status_of(a)), 30, "A to register with the relay")
    invite = scenario.invite("ha", a)
    id_b = scenario.start_node(
        "b", "hb", node_args("join", b, "--invite", "-", *shard(model, "9:18"), *backoff), invite
    )
    wait_for(
        lambda: scenario.alive("b") or ((status_of(b) or {}).get("node") or {}).get("serving"),
        120,
        "B to serve",
    )

    def paths() -> tuple[str | None, str | None]:
        return peer_entry(status_of(a), id_b).get("path"), peer_entry(status_of(b), id_a).get("path")

    wait_for(lambda: paths() == ("relayed", "relayed"), 60, "A<->B relayed")

    def warm_up() -> bool:
        # The head needs B's shard in its peer table and a route before it answers at all.
        try:
            generate(lab, 2)
        except BenchFailure:
            return False
        return True

    wait_for(warm_up, 120, "a first answer through A's API", interval=1.0)

    def one(label: str) -> Generation:
        before_relay, before_a = relay_forwarded(relay_dir), peer_entry(status_of(a), id_b)["relay_bytes"]
        on = paths()
        answer = generate(lab, MAX_TOKENS)
        after_relay, after_a = relay_forwarded(relay_dir), peer_entry(status_of(a), id_b)["relay_bytes"]
        usage = answer.get("usage") or {}
        made = Generation(
            label,
            on,
            after_relay - before_relay,
            after_a - before_a,
            float(answer["seconds"]),
            int(usage.get("completion_tokens", -1)),
            str(answer["text"]),
        )
        print(
            f"  {label}: paths {on}, relay forwarded {made.relay_bytes} bytes, A's relay_bytes for B "
            f"+{made.a_relay_bytes}; {made.tokens} tokens in {made.seconds:.2f} s"
            f" ({answer['finish_reason']}), paths after {paths()}"
        )
        return made

    relayed = one("relayed (homes cut)")
    lab.join_homes()
    joined = time.monotonic()
    wait_for(lambda: paths() == ("punched", "punched"), 240, "A<->B punched after join_homes", interval=0.2)
    punched_after = time.monotonic() - joined
    print(
        f"  homes joined: punched {punched_after:.1f} s later; waiting {DRAIN_S:g} s for the relayed link to close"
    )
    time.sleep(DRAIN_S)
    direct = one("punched")
    ratio = direct.relay_bytes / relayed.relay_bytes if relayed.relay_bytes else float("nan")
    same = relayed.text == direct.text
    print(
        f"bytes: relayed {relayed.relay_bytes} B, after the upgrade {direct.relay_bytes} B per generation: "
        f"{ratio:.2%} (target < 5 %); texts identical: {same}"
    )
    if not same:
        print(f"  relayed text: {relayed.text!r}\n  punched text: {direct.text!r}")
    else:
        print(f"  the text: {relayed.text[:120]!r}...")
    return {
        "relayed": relayed,
        "direct": direct,
        "ratio": ratio,
        "same": same,
        "punched_after_s": punched_after,
    }


# -- 3. rtt ------------------------------------------------------------------------------------------

WIRE_ECHO_SERVER = """
import socket
server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
server.bind(("0.0.0.0", 9999))
print("echo ready", flush=True)
while True:
    data, sender = server.recvfrom(4096)
    server.sendto(data, sender)
"""

WIRE_ECHO_CLIENT = """
import json, socket, sys, time
client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
client.settimeout(2.0)
rtts = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    client.sendto(b"x" * 1200, (sys.argv[1], 9999))
    client.recvfrom(4096)
    rtts.append((time.perf_counter() - started) * 1000)
    time.sleep(0.01)
print(json.dumps(rtts))
"""


def summarize(samples: list[float]) -> str:
    return (
        f"median {statistics.median(samples):.1f} ms, p90 {percentile(samples, 90):.1f} ms (n={len(samples)})"
    )


def rtt_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    print(f"\n== rtt: relay {args.delay_ms:g} ms away from each home (one way), relayed vs punched ==")
    with lab_up("home") as lab:
        scenario = Scenario(lab, work / "rtt")
        try:
            lab.add_far_host(args.delay_ms, log=scenario.log("wire"))
            return measure_rtt(args, lab, scenario)
        finally:
            scenario.stop()


def measure_rtt(args: argparse.Namespace, lab: NatLab, scenario: Scenario) -> dict[str, Any]:
    scenario.spawn("echo", "far", [sys.executable, "-c", WIRE_ECHO_SERVER])
    wait_for(lambda: b"echo ready" in scenario.log("echo").read_bytes(), 20, "the echo server")
    echoed = lab.run("ha", [sys.executable, "-c", WIRE_ECHO_CLIENT, FAR_ADDRESS, "50"])
    if echoed.returncode != 0:
        raise BenchFailure(f"no UDP echo over the wire: {echoed.stderr}")
    wire = [float(x) for x in json.loads(echoed.stdout)]
    print(f"  wire check: UDP 1200-byte echo, home A <-> far host: {summarize(wire)}")

    relay_dir = scenario.dir("r")
    relay_arg = f"{relay_id_of(lab, 'far', relay_dir)}@{FAR_ADDRESS}:{RELAY_PORT}"
    lab.cut_between_homes()
    backoff = ("--punch-backoff", f"{BACKOFF_S:g}")
    c = scenario.dir("c")
    scenario.start_node("c", "pub", public_creator(scenario, relay_arg, *backoff))
    scenario.start_relay("far", FAR_ADDRESS, relay_dir, mesh_id_of(c))
    wait_for(lambda: relay_registered(status_of(c)), 30, "C to register with the relay")
    b = scenario.dir("b")
    id_b = scenario.start_node(
        "b", "hb", node_args("join", b, "--invite", "-", *backoff), scenario.invite("pub", c)
    )
    wait_for(lambda: relay_registered(status_of(b)), 60, "B to register with the relay")
    invite_file = scenario.root / "a.invite"
    invite_file.write_text(scenario.invite("pub", c))
    out = scenario.root / "rtt.json"
    scenario.spawn(
        "a",
        "ha",
        [
            sys.executable, str(SCRIPT), "probe-client", str(scenario.dir("a")), str(invite_file), id_b, str(out),
            "--round-trips", str(args.round_trips), "--punch-backoff", f"{BACKOFF_S:g}",
        ],
    )  # fmt: skip
    log_a = scenario.log("a")
    wait_for(
        lambda: scenario.alive("a") or b"RELAYED DONE" in log_a.read_bytes(),
        120 + args.round_trips * 0.5,
        "A's round trips over the relay",
        interval=0.2,
    )
    lab.join_homes()
    wait_for(
        lambda: out.exists() or scenario.alive("a"),
        300,
        "A's round trips over the punched path",
        interval=0.2,
    )
    measured = json.loads(out.read_text())
    relayed, direct = measured["relayed"], measured["direct"]
    ratio = statistics.median(relayed) / statistics.median(direct)
    print(f"  relayed (homes cut), on the link: {summarize(relayed)}")
    print(
        f"  relayed, the node's probe: {summarize(measured['relayed_probe'])}{slow_share(measured['relayed_probe'], relayed)}"
    )
    print(
        f"  punched ({measured['punched_after_s']:.1f} s after the homes were joined), on the link: {summarize(direct)}"
    )
    print(f"  punched, the node's probe: {summarize(measured['direct_probe'])}")
    print(
        f"  skipped (link changed or no reply): {measured['relayed_skipped']} relayed, {measured['direct_skipped']} punched"
    )
    print(
        f"rtt: relayed / punched median {ratio:.1f}x; {args.delay_ms:g} ms each way between each home and the relay"
    )
    return {"wire": wire, "ratio": ratio, **measured}


def slow_share(probes: list[float], on_link: list[float]) -> str:
    """How many of the node's probes took over 1.5 round trips of the link (a second exchange)."""
    limit = 1.5 * statistics.median(on_link)
    slow = sum(1 for sample in probes if sample > limit)
    return f"; {slow}/{len(probes)} over 1.5x the link's median"


# -- the probe client (part 3's A, run inside ha) ------------------------------------------------------


async def _round_trips(
    node: Any, peer: bytes, count: int, expect: str
) -> tuple[list[float], list[float], int]:
    """``count`` pairs of round trips to ``peer`` in ms, on a link whose path is ``expect``: a PROBE
    request and its echo on the live link itself, then the node's own ``probe`` (which asks for
    the link first); how many pairs were skipped (made up for) because the link changed or a
    reply did not come."""
    from meshnode.transport.request_reply import REQUEST_FAILURES, request_reply
    from meshnode.wire.framing import NODE_PROTOCOL_GENERATION, StreamType
    from meshnode.wire.pb import mesh

    on_link: list[float] = []
    via_probe: list[float] = []
    skipped = 0
    while len(on_link) < count:
        link = node.link_to(peer)
        usable = link is not None and node.traversal.path_of(link).value == expect
        if usable:
            nonce = os.urandom(16)
            message = mesh.Probe(gen=NODE_PROTOCOL_GENERATION, nonce=nonce).SerializeToString()
            started = time.perf_counter()
            try:
                reply = await request_reply(link, StreamType.PROBE, message, timeout=5.0)
            except REQUEST_FAILURES:
                reply = None
            link_ms = (time.perf_counter() - started) * 1000
            await asyncio.sleep(0.01)
            started = time.perf_counter()
            answered = await node.probe(peer, timeout=5.0)
            probe_ms = (time.perf_counter() - started) * 1000
            echoed = reply is not None and mesh.Probe.FromString(reply).nonce == nonce
            if echoed and answered and node.link_to(peer) is link:
                on_link.append(link_ms)
                via_probe.append(probe_ms)
                await asyncio.sleep(0.01)
                continue
        skipped += 1
        if skipped > count:
            raise RuntimeError(f"more than {count} round trips not on a {expect} path")
        await asyncio.sleep(0.1)
    return on_link, via_probe, skipped


async def probe_client(args: argparse.Namespace) -> int:
    from helpers.mesh_nodes import start_invited_node

    from meshnode.membership.credentials import decode_invite_token
    from meshnode.node import NodeConfig
    from meshnode.traversal.config import TraversalConfig
    from meshnode.traversal.pair_backoff import PunchSchedule

    config = NodeConfig(
        listen=f"0.0.0.0:{PROBE_PORT}",
        heartbeat_interval=0.5,
        directly_reachable=False,
        traversal=TraversalConfig(schedule=PunchSchedule(first_backoff_s=args.punch_backoff)),
    )
    node = await start_invited_node(
        Path(args.data_dir), config, decode_invite_token(Path(args.invite_file).read_text())
    )
    peer = bytes.fromhex(args.peer)
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 60
        while not await node.probe(peer, timeout=5.0):
            if loop.time() > deadline:
                raise RuntimeError("B never answered a probe")
        # The first round trips of a link pay for its setup; measure a link in its steady state.
        await _round_trips(node, peer, 5, "relayed")
        relayed, relayed_probe, relayed_skipped = await _round_trips(node, peer, args.round_trips, "relayed")
        print("RELAYED DONE", flush=True)
        joined = loop.time()
        while (link := node.link_to(peer)) is None or node.traversal.path_of(link).value != "punched":
            if loop.time() - joined > 240:
                raise RuntimeError("no punched path to B within 240 s of the homes joining")
            await asyncio.sleep(0.1)
        punched_after = loop.time() - joined
        await asyncio.sleep(DRAIN_S)
        await _round_trips(node, peer, 5, "punched")
        direct, direct_probe, direct_skipped = await _round_trips(node, peer, args.round_trips, "punched")
        result = {
            "relayed": relayed,
            "relayed_probe": relayed_probe,
            "relayed_skipped": relayed_skipped,
            "direct": direct,
            "direct_probe": direct_probe,
            "direct_skipped": direct_skipped,
            "punched_after_s": punched_after,
        }
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.rename(args.out)
        print("DIRECT DONE", flush=True)
        return 0
    finally:
        await node.shutdown()


def probe_client_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nat_traversal.py probe-client")
    parser.add_argument("data_dir")
    parser.add_argument("invite_file")
    parser.add_argument("peer", help="B's node id (hex)")
    parser.add_argument("out")
    parser.add_argument("--round-trips", type=int, default=200)
    parser.add_argument("--punch-backoff", type=float, default=BACKOFF_S)
    import uvloop

    return uvloop.run(probe_client(parser.parse_args(argv)))


# -- the summary ---------------------------------------------------------------------------------------


def summary(
    args: argparse.Namespace,
    success: list[PresetResult] | None,
    moved: dict[str, Any] | None,
    rtt: dict[str, Any] | None,
) -> str:
    lines: list[str] = []
    if success:
        lines += [
            f"Success, {args.pairs} fresh pairs per preset (time to direct from both listing each other):",
            "",
            "| preset | direct | window | time to direct p50 / p95 | punch attempts (both sides, all pairs) |",
            "|---|---|---|---|---|",
        ]
        for result in success:
            done = result.successes
            timing = f"{percentile(done, 50):.2f} / {percentile(done, 95):.2f} s" if done else "-"
            attempts = ", ".join(f"{k} {n}" for k, n in sorted(result.attempts.items())) or "none"
            lines.append(
                f"| {result.preset} | {len(done)}/{len(result.pairs)} | {result.window_s:g} s | {timing} | {attempts} |"
            )
        lines.append("")
    if moved:
        relayed, direct = moved["relayed"], moved["direct"]
        lines += [
            f"Relay bytes per {MAX_TOKENS}-token greedy generation, Gemma 3 270M split 0:9 (ha) / 9:18 (hb):",
            "",
            "| A<->B path | relay bytes_forwarded | A's relay_bytes for B | tokens | seconds |",
            "|---|---|---|---|---|",
            f"| relayed (homes cut) | {relayed.relay_bytes} | {relayed.a_relay_bytes} | {relayed.tokens} | {relayed.seconds:.2f} |",
            f"| punched | {direct.relay_bytes} | {direct.a_relay_bytes} | {direct.tokens} | {direct.seconds:.2f} |",
            "",
            f"After the upgrade / relayed: {moved['ratio']:.2%} (target < 5 %); texts identical: {moved['same']};"
            f" punched {moved['punched_after_s']:.1f} s after the homes were joined.",
            "",
        ]
    if rtt:
        lines += [
            f"Round trip A (ha) <-> B (hb), relay {args.delay_ms:g} ms from each home each way (delay wire):",
            "",
            "| path | median | p90 | samples |",
            "|---|---|---|---|",
            f"| UDP echo home A <-> relay host (the wire alone) | {statistics.median(rtt['wire']):.1f} ms | "
            f"{percentile(rtt['wire'], 90):.1f} ms | {len(rtt['wire'])} |",
        ]
        for label, key in (
            ("relayed, PROBE on the link", "relayed"),
            ("punched, PROBE on the link", "direct"),
            ("relayed, the node's probe()", "relayed_probe"),
            ("punched, the node's probe()", "direct_probe"),
        ):
            samples = rtt[key]
            lines.append(
                f"| {label} | {statistics.median(samples):.1f} ms | {percentile(samples, 90):.1f} ms | {len(samples)} |"
            )
        lines += ["", f"Relayed / punched median (on the link): {rtt['ratio']:.1f}x.", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=20, help="fresh pairs per preset (default 20)")
    parser.add_argument(
        "--presets", default=",".join(PRESETS), help=f"comma-separated, of {', '.join(PRESETS)}"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=25.0, help="rtt: one-way delay to the relay (default 25)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--pair-timeout", type=float, default=30.0, help="success: seconds to go direct (30)")
    parser.add_argument(
        "--symmetric-window",
        type=float,
        default=15.0,
        help="success: seconds a symmetric pair is watched (15)",
    )
    parser.add_argument("--round-trips", type=int, default=200, help="rtt: samples per path (default 200)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (data dirs, logs)")
    args = parser.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    args.parts = [p for p in args.parts.split(",") if p]
    for preset in args.presets:
        if preset not in PRESETS:
            parser.error(f"unknown preset {preset!r}")
    for part in args.parts:
        if part not in PARTS:
            parser.error(f"unknown part {part!r}")
    return args


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, through every `finally` that takes a lab down.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    sweep_stale()
    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="nat-traversal-"))
    print(f"work directory {work}")
    success = moved = rtt = None
    keep = args.keep
    try:
        if "success" in args.parts:
            success = success_part(args, work)
            keep = keep or any(
                pair.failure or (result.preset != "symmetric" and pair.direct_s is None)
                for result in success
                for pair in result.pairs
            )
        if "bytes" in args.parts:
            moved = bytes_part(args, work)
        if "rtt" in args.parts:
            rtt = rtt_part(args, work)
    except KeyboardInterrupt:
        keep = True
        print("interrupted: the lab is taken down", file=sys.stderr)
        return 130
    except BaseException:
        keep = True
        raise
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n----- summary (for bench/RESULTS.md) -----\n")
    print(summary(args, success, moved, rtt))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "probe-client":
        sys.exit(probe_client_main(sys.argv[2:]))
    sys.exit(main())
