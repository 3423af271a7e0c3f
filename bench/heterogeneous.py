"""Mixed machines (issue 55): speed-aware placement against memory-only placement and the ideal split.

    python bench/heterogeneous.py [--size large] [--slow-share 0.33] [--first-layers 4]
                                  [--joiner-layers 7] [--slow-joiner-layers N] [--tokens 24] [--runs 3] [--streams 4]
                                  [--threads 1] [--ctx 512] [--join-order race|slow-first|fast-first]
                                  [--interleave R]

Three real ``meshnode`` processes on this machine, three times over, each time a fresh mesh:

1. **memory**: A is created with the model (bench/random_model.py's ``large`` shape by default:
   12 layers, n_embd 2048, float16, 1.3 GB) serving [0, ``--first-layers``); B and C join at the
   same moment (``--join-order race``; or one after the other, the first serving before the
   second starts: with memory-only placement whoever claims the gap first takes it, so the race
   makes that comparison a coin toss) with only an invite, no model, each with a ``--memory-budget`` of
   ``--joiner-layers`` layers and the output table, and ``--place-by memory`` (placement by
   bytes, as before issue 55). C is slowed: its process (and every thread and child it starts)
   is put in a CPU cgroup with a quota of ``--slow-share`` of one core in every 10 ms period
   (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; root needed), from the moment it starts, so its speed probe,
   fetch and serving are all slow, as on a slow machine.
2. **time**: the same, with ``--place-by time`` (the default): each joiner probes its speed
   before it claims, claims announce it, and ranges go by time.
3. **ideal**: A keeps its range (the creator's is the person's choice, not placement's); of the
   splits of the rest between B and C, in either order, within their budget, the one whose
   slowest stage is fastest at the speeds the memory mesh's nodes measured (each node's
   announced decode time for its range, as bytes of weights a step reads per ms, the output
   projection at the tail), then the one whose stages sum least: the nodes started with those
   ranges given (``--layers``), no placement involved.

In each mesh, after a warm-up generation (and, where nodes placed themselves, once no node has
moved for ``--settle`` seconds, a short generation every few seconds meanwhile: a joiner that
claimed before a faster one arrived moves once the gain has lasted a minute): ``--runs`` greedy generations of ``--tokens`` tokens
one at a time through A's API (decode tokens/s, the median), then ``--runs`` times
``--streams`` at once (their decode tokens together over the time from the first one's first
token to the last one's end; the median). The summary prints time ÷ memory (issue target >= 1.3) and time ÷ ideal (target
>= 0.9), one stream and ``--streams``.

With ``--interleave R`` the three layouts the meshes ended on are then started again with their
ranges given, in R rounds, memory, time and ideal side by side in each (the order turning), and
the ratios are printed again from those rounds' medians: placing a mesh takes minutes, over which
a shared machine's load drifts, and the layouts compared in one round share it.

All processes share this machine's cores; each node runs ``--threads`` threads (1 by default:
three nodes on 2 cores). What the quota does to C is what a machine a third as fast does; what
sharing does to A and B (two fast nodes on the rest of the cores) is not a separate machine's
isolation, so the concurrent figure is a lower bound of what three machines would show.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from big_model import api_run, joiner_budget  # noqa: E402
from random_model import SIZES, ensure_random_model  # noqa: E402

from engines.gguf_file import metadata_int, read_gguf  # noqa: E402
from engines.openmp_wait import available_cpus, openmp_wait_env  # noqa: E402
from meshnode.app.local_mesh import Child, LocalMesh  # noqa: E402
from meshnode.app.split_command import memory_fits  # noqa: E402
from meshnode.autoplace.stage_balance import NoSplitError, StepCosts, step_costs  # noqa: E402

MIB = 1 << 20
NODES = ("A", "B", "C")
SLOW = "C"
JOIN_TIMEOUT_S = 1800.0
Layers = tuple[int, int]


# ---------------------------------------------------------------------------- the slow machine


class CpuQuota:
    """A CPU cgroup whose processes together get ``share`` of one core, v2 or v1."""

    # Short, so the quota binds within a few milliseconds: with the default 100 ms a 6 ms probe
    # decode runs at full speed on the period's budget (the slowed node probed itself as fast as
    # the others), while a slow machine is slow in every millisecond.
    PERIOD_US = 10_000

    def __init__(self, share: float) -> None:
        name = f"meshnode-bench-slow-{os.getpid()}"
        quota = max(1_000, round(self.PERIOD_US * share))
        v2 = Path("/sys/fs/cgroup")
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            # The cpu controller must be on for the root's children (a no-op where it already is).
            with contextlib.suppress(OSError):
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            self.path = v2 / name
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            self.kind = "cgroup v2 cpu.max"
        elif (v1 / "cpu.cfs_quota_us").exists():
            self.path = v1 / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            self.kind = "cgroup v1 cpu.cfs_quota_us"
        else:
            raise SystemExit(
                "no CPU cgroup controller here (/sys/fs/cgroup cgroup.controllers without cpu, no "
                "/sys/fs/cgroup/cpu): run as root on Linux with the cpu controller"
            )
        self.description = f"{self.kind} {quota}/{self.PERIOD_US} us"

    def add(self, pid: int) -> None:
        # Threads and children started later inherit the group.
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


@contextlib.contextmanager
def cpu_quota(share: float) -> Iterator[CpuQuota]:
    quota = CpuQuota(share)
    try:
        yield quota
    finally:
        quota.remove()


# ---------------------------------------------------------------------------- one mesh


@dataclass
class MeshRun:
    label: str
    ranges: dict[str, Layers] = field(default_factory=dict)
    # Each node's announced decode time for its range, ms a token, and how it was obtained.
    decode_ms: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    placed_by: dict[str, str] = field(default_factory=dict)
    single_tps: float = 0.0
    concurrent_tps: float = 0.0
    moved: bool = False
    # The route A's head would take now, as its status says: node[start, end) per hop.
    route: str = ""


def _serving(child: Child) -> dict[str, Any] | None:
    status = child.status()
    return None if status is None else status["node"].get("serving")


def _snapshot(mesh: LocalMesh, run: MeshRun) -> dict[str, Layers]:
    ranges = {}
    for name in NODES:
        child = mesh.child(name)
        status = child.status() or {}
        serving = status.get("node", {}).get("serving")
        if serving is None:
            continue
        ranges[name] = (int(serving["start_layer"]), int(serving["end_layer"]))
        if serving.get("decode_ms_per_token") is not None:
            run.decode_ms[name] = float(serving["decode_ms_per_token"])
            run.sources[name] = f"{serving['speed_source']}, {serving['speed_samples']} samples"
        placement = status.get("sections", {}).get("placement", {})
        if placement.get("placed_by"):
            run.placed_by[name] = str(placement["placed_by"])
    return ranges


async def _concurrent(api: str, prompts: list[list[int]], tokens: int) -> float:
    """Decode tokens of every stream over the time from the first first token to the last end."""
    from meshnode.head.api_client import StreamSummary, stream_completion

    async def one(prompt: list[int]) -> tuple[float, float, int]:
        body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}  # fmt: skip
        started = time.monotonic()
        async for event in stream_completion(api, "/v1/completions", body, timeout_s=600):
            if isinstance(event, StreamSummary):
                return (started + event.time_to_first_token_s, started + event.total_s,
                        event.completion_tokens - 1)  # fmt: skip
        raise RuntimeError("a stream ended without its summary")

    spans = await asyncio.gather(*(one(p) for p in prompts))
    first = min(s[0] for s in spans)
    last = max(s[1] for s in spans)
    return sum(s[2] for s in spans) / (last - first)


async def run_mesh(
    args: argparse.Namespace,
    label: str,
    model: Path,
    work: Path,
    env: dict[str, str],
    quota: CpuQuota,
    budgets: dict[str, int],
    prompts: list[list[int]],
    given: dict[str, Layers] | None = None,
) -> MeshRun:
    """One mesh: placed by ``label`` ("memory" or "time") or, with ``given``, started on those ranges."""
    run = MeshRun(label)
    mesh = LocalMesh(work / label, model, threads=args.threads, ctx=args.ctx, env=env, timing=())
    (work / label).mkdir()
    started = time.monotonic()
    try:
        mesh.create_mesh("A")
        first = given["A"] if given else (0, args.first_layers)
        await mesh.start_first("A", first)
        token = mesh.invite("A")
        joiners = []
        for name in _join_order(args.join_order):
            if given:
                child = mesh.join(name, given[name], token)
            else:
                data_dir = work / label / name
                child = mesh.spawn(
                    name, "join", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0",
                    "--threads", str(args.threads), "--ctx", str(args.ctx), "--api-listen", "off",
                    "--memory-budget", str(budgets[name]), "--place-by", label,
                    env={"MESHNODE_INVITE": token, "MESHNODE_CACHE_DIR": str(work / label / f"{name}-cache")},
                    data_dir=data_dir,
                )  # fmt: skip
            if name == SLOW:
                quota.add(child.process.pid)
            joiners.append(child)
            if args.join_order != "race" and given is None:
                # In turn: the first joiner places itself alone, as a machine that joined earlier did
                # (serving, not only claimed: a claim's range can still be lost to another's).
                await _placed(mesh, child)
        for child in joiners:
            await mesh.wait_serving(child)
        api, _ = await mesh.wait_route("A")
        print(f"  {label}: serving after {time.monotonic() - started:.0f} s", flush=True)
        api = await _warmed_up(mesh, api, prompts[0])
        if given is None:
            api = await _settled(args, mesh, run, api, prompts[0])
        run.ranges = _snapshot(mesh, run)
        singles = [
            (await api_run(api, prompts[i % len(prompts)], args.tokens)).decode_tps for i in range(args.runs)
        ]
        run.single_tps = statistics.median(singles)
        concurrent = [await _concurrent(api, prompts[: args.streams], args.tokens) for _ in range(args.runs)]
        run.concurrent_tps = statistics.median(concurrent)
        after = _snapshot(mesh, run)
        run.route = _route(mesh)
        run.moved = after != run.ranges
        if run.moved:
            print(f"  {label}: ranges moved during the measurement: {run.ranges} -> {after}", flush=True)
        print(
            f"  {label}: ranges {_ranges(run.ranges)}; announced ms/token "
            + ", ".join(f"{n} {run.decode_ms[n]:.1f} ({run.sources[n]})" for n in NODES if n in run.decode_ms)
            + (f"; placed by {run.placed_by}" if run.placed_by else "")
            + f"; route {run.route or 'not shown'}"
            + f"; decode {run.single_tps:.2f} tokens/s one stream (runs {', '.join(f'{t:.2f}' for t in singles)}),"
            f" {run.concurrent_tps:.2f} with {args.streams} streams (runs {', '.join(f'{t:.2f}' for t in concurrent)})",
            flush=True,
        )
        return run
    finally:
        mesh.stop_all()


async def _interleaved(
    args: argparse.Namespace,
    layouts: dict[str, dict[str, Layers]],
    model: Path,
    work: Path,
    env: dict[str, str],
    quota: CpuQuota,
    budgets: dict[str, int],
    prompts: list[list[int]],
) -> dict[str, tuple[float, float]]:
    """Each layout started again with its ranges given, in ``--interleave`` rounds, the order
    turning each round: on a shared machine the load drifts over the minutes one placed mesh
    takes, and layouts measured side by side in every round share it. Per layout, the median of
    the rounds' one-stream and concurrent figures."""
    labels = list(layouts)
    measured: dict[str, list[MeshRun]] = {label: [] for label in labels}
    for round_index in range(args.interleave):
        order = labels[round_index % len(labels) :] + labels[: round_index % len(labels)]
        for label in order:
            run = await run_mesh(
                args, f"{label}-given-{round_index + 1}", model, work, env, quota, budgets, prompts,
                layouts[label],
            )  # fmt: skip
            measured[label].append(run)
    return {
        label: (
            statistics.median(r.single_tps for r in runs),
            statistics.median(r.concurrent_tps for r in runs),
        )
        for label, runs in measured.items()
    }


async def _placed(mesh: LocalMesh, child: Child) -> None:
    """Until ``child`` serves the range it placed itself on (its claim fetched and loaded)."""

    def serving() -> bool:
        status = child.status()
        return status is not None and (status["node"]["serving"] or {}).get("state") == "serving"

    await mesh.until(child, "placing itself and loading its layers", serving)


def _join_order(order: str) -> tuple[str, ...]:
    """Who joins first: ``race`` starts both at once (the claims race); ``slow-first`` lets the slowed
    node place itself alone before the other starts, ``fast-first`` the other way round."""
    fast = next(name for name in ("B", "C") if name != SLOW)
    return {"race": ("B", "C"), "slow-first": (SLOW, fast), "fast-first": (fast, SLOW)}[order]


async def _warmed_up(mesh: LocalMesh, api: str, prompt: list[int], timeout_s: float = 300.0) -> str:
    """After a first generation: a node that has just placed itself may still be loading (its
    range announced, its shard not yet usable), so the route is asked for again until one runs."""
    from meshnode.head.api_client import ApiError

    started = time.monotonic()
    while True:
        try:
            await api_run(api, prompt, 4)
            return api
        except ApiError as exc:
            if time.monotonic() - started > timeout_s:
                raise
            print(f"  not ready yet ({exc}); again in 5 s", flush=True)
            await asyncio.sleep(5)
            api, _ = await mesh.wait_route("A")


async def _settled(
    args: argparse.Namespace, mesh: LocalMesh, run: MeshRun, api: str, prompt: list[int]
) -> str:
    """Until no node has moved for ``--settle`` seconds (at most ``--settle-max``), with a short
    generation every few seconds so that the nodes' speeds are live ones: a joiner that claimed
    before a faster one arrived may move once the gain has lasted (``--move-settle``, 60 s)."""
    started = time.monotonic()
    ranges = _snapshot(mesh, run)
    still_since = started
    while time.monotonic() - still_since < args.settle and time.monotonic() - started < args.settle_max:
        with contextlib.suppress(Exception):  # a route may be down while a node reloads
            await api_run(api, prompt, 4)
        await asyncio.sleep(3)
        now = _snapshot(mesh, run)
        if now != ranges:
            print(f"  {run.label}: +{time.monotonic() - started:.0f} s moved: {_ranges(ranges)} -> {_ranges(now)}",
                  flush=True)  # fmt: skip
            ranges, still_since = now, time.monotonic()
    if time.monotonic() - still_since < args.settle:
        print(f"  {run.label}: still moving after {args.settle_max:.0f} s", flush=True)
    api, _ = await mesh.wait_route("A")
    return api


def _route(mesh: LocalMesh) -> str:
    """A's head's route now (its status' routes section), its hops named by node."""
    from meshnode.identity import short_id

    names = {}
    for name in NODES:
        status = mesh.child(name).status() or {}
        if node_id := status.get("node", {}).get("id"):
            names[short_id(bytes.fromhex(node_id))] = name
    status = mesh.child("A").status() or {}
    routes = (status.get("sections", {}).get("routes") or {}).get("routes") or []
    return "; ".join(
        " ".join(
            f"{names.get(hop['node'], hop['node'])}[{hop['layers'][0]},{hop['layers'][1]})"
            for hop in route["hops"]
        )
        for route in routes
    )


def _ranges(ranges: dict[str, Layers]) -> str:
    return " ".join(f"{n}[{r[0]},{r[1]})" for n, r in sorted(ranges.items(), key=lambda item: item[1]))


# ---------------------------------------------------------------------------- the ideal split


def ideal_split(
    costs: StepCosts, gguf: Any, n_layers: int, first: Layers, memory: MeshRun, budgets: dict[str, int]
) -> tuple[dict[str, Layers], dict[str, float]]:
    """A keeps ``first`` (the creator's range is the person's choice, not placement's); of the
    splits of the rest between B and C in either order within their budget, the one whose
    slowest stage is fastest at the speeds the memory mesh measured (bytes a ms), then the one
    whose stages sum least (one stream's token)."""
    speeds = {n: costs.stage(memory.ranges[n]) / memory.decode_ms[n] for n in NODES}
    joiners = ("B", "C")
    fits = memory_fits(gguf, n_layers, [budgets[n] for n in joiners])
    best: tuple[tuple[float, float], dict[str, Layers]] | None = None
    for near, far in (("B", "C"), ("C", "B")):
        for cut in range(first[1] + 1, n_layers):
            split = {"A": first, near: (first[1], cut), far: (cut, n_layers)}
            if not (fits(joiners.index(near), *split[near]) and fits(joiners.index(far), *split[far])):
                continue
            times = [costs.stage(split[n]) / speeds[n] for n in NODES]
            key = (max(times), sum(times))
            if best is None or key < best[0]:
                best = (key, split)
    if best is None:
        raise NoSplitError(
            f"no split of [{first[1]}, {n_layers}) between B and C fits their budgets ({budgets} bytes)"
        )
    return best[1], speeds


# ---------------------------------------------------------------------------- main


async def main_async(args: argparse.Namespace) -> None:
    started = time.monotonic()
    model = ensure_random_model(args.size)
    gguf = read_gguf(model)
    n_layers = metadata_int(gguf.get(f"{gguf.architecture}.block_count"))
    costs = step_costs(n_layers, {t.name: t.nbytes for t in gguf.tensors})
    budget = joiner_budget(model, args.joiner_layers)
    slow_layers = args.joiner_layers if args.slow_joiner_layers is None else args.slow_joiner_layers
    budgets = {"B": budget, "C": budget}
    budgets[SLOW] = joiner_budget(model, slow_layers)
    n_vocab = next(int(t.shape[1]) for t in gguf.tensors if t.name == "token_embd.weight")
    rng = np.random.default_rng(55)
    prompts = [
        [1, *(int(t) for t in rng.integers(300, min(30_000, n_vocab), size=15))] for _ in range(args.streams)
    ]
    env = openmp_wait_env(3, args.threads, available_cpus(), others=1)
    print(f"joiners: {args.join_order}", flush=True)
    print(f"model {model.name}: {n_layers} layers, {model.stat().st_size / 1e9:.2f} GB; A serves [0, "
          f"{args.first_layers}), joiners' --memory-budget {budget / MIB:.0f} MiB ({args.joiner_layers} layers "
          f"and the output table)"
          + (f", {SLOW}'s {budgets[SLOW] / MIB:.0f} MiB ({slow_layers} layers)" if slow_layers != args.joiner_layers else "")
          + f"; {args.threads} thread(s) a node, {available_cpus()} cores", flush=True)  # fmt: skip
    runs: dict[str, MeshRun] = {}
    replayed: dict[str, tuple[float, float]] = {}
    with cpu_quota(args.slow_share) as quota, tempfile.TemporaryDirectory(prefix="heterogeneous-") as tmp:
        print(f"{SLOW} is slowed to {args.slow_share:g} of a core ({quota.description})", flush=True)
        work = Path(tmp) if args.work_dir is None else args.work_dir
        work.mkdir(parents=True, exist_ok=True)
        for mode in ("memory", "time"):
            if mode in args.modes:
                runs[mode] = await run_mesh(args, mode, model, work, env, quota, budgets, prompts)
        if "ideal" not in args.modes or "memory" not in runs:
            pass
        elif all(n in runs["memory"].decode_ms for n in NODES):
            try:
                given, speeds = ideal_split(
                    costs, gguf, n_layers, (0, args.first_layers), runs["memory"], budgets
                )
            except NoSplitError as exc:
                print(f"  ideal: no split fits the budgets ({exc})", flush=True)
            else:
                print("  ideal: speeds measured by the memory mesh, MB a step reads per second: "
                      + ", ".join(f"{n} {speeds[n] * 1000 / 1e6:.0f}" for n in NODES)
                      + f"; split {_ranges(given)}", flush=True)  # fmt: skip
                runs["ideal"] = await run_mesh(
                    args, "ideal", model, work, env, quota, budgets, prompts, given
                )
        else:
            print("  ideal: skipped, a node of the memory mesh announced no speed", flush=True)
        if args.interleave and {"memory", "time", "ideal"} <= set(runs):
            layouts = {label: runs[label].ranges for label in ("memory", "time", "ideal")}
            replayed = await _interleaved(args, layouts, model, work, env, quota, budgets, prompts)
    print("\nsummary (decode tokens/s; one stream, then "
          f"{args.streams} at once):", flush=True)  # fmt: skip
    for label, run in runs.items():
        print(f"  {label:7} {_ranges(run.ranges):32} {run.single_tps:6.2f} {run.concurrent_tps:6.2f}"
              + ("  (ranges moved while measured)" if run.moved else ""), flush=True)  # fmt: skip
    if "memory" not in runs or "time" not in runs:
        return
    memory, timed = runs["memory"], runs["time"]
    print(f"  time / memory: {timed.single_tps / memory.single_tps:.2f} one stream, "
          f"{timed.concurrent_tps / memory.concurrent_tps:.2f} {args.streams} streams (target >= 1.3)")  # fmt: skip
    if "ideal" in runs:
        ideal = runs["ideal"]
        print(f"  time / ideal:  {timed.single_tps / ideal.single_tps:.2f} one stream, "
              f"{timed.concurrent_tps / ideal.concurrent_tps:.2f} {args.streams} streams (target >= 0.9)")  # fmt: skip
    if replayed:
        print(
            f"\nthe three layouts again, given, in {args.interleave} interleaved rounds (median of the rounds):"
        )
        for label, (single, concurrent) in replayed.items():
            print(f"  {label:7} {_ranges(runs[label].ranges):32} {single:6.2f} {concurrent:6.2f}")
        (ts, tc), (ms, mc), (is_, ic) = replayed["time"], replayed["memory"], replayed["ideal"]
        print(
            f"  time / memory: {ts / ms:.2f} one stream, {tc / mc:.2f} {args.streams} streams (target >= 1.3)"
        )
        print(
            f"  time / ideal:  {ts / is_:.2f} one stream, {tc / ic:.2f} {args.streams} streams (target >= 0.9)"
        )
    print(f"whole run {time.monotonic() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="large", help="bench/random_model.py's (large)"
    )
    parser.add_argument("--slow-share", type=float, default=0.33, help="C's CPU, a share of one core (0.33)")
    parser.add_argument("--first-layers", type=int, default=4, help="A's layers [0, N) (4)")
    parser.add_argument("--joiner-layers", type=int, default=7, help="layers a joiner's budget holds (7)")
    parser.add_argument(
        "--slow-joiner-layers",
        type=int,
        help="layers the slowed joiner's budget holds (--joiner-layers): a slow machine with much memory, "
        "which placement by bytes hands the most layers",
    )
    parser.add_argument("--tokens", type=int, default=24, help="generated per request (24)")
    parser.add_argument(
        "--runs", type=int, default=3, help="one-stream generations and concurrent rounds, median (3)"
    )
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams (4)")
    parser.add_argument("--threads", type=int, default=1, help="threads a node (1)")
    parser.add_argument("--ctx", type=int, default=512, help="context a session (512)")
    parser.add_argument(
        "--settle",
        type=float,
        default=90.0,
        help="placed meshes: seconds without a move before measuring (90)",
    )
    parser.add_argument("--settle-max", type=float, default=300.0, help="placed meshes: longest wait (300)")
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=["memory", "time", "ideal"],
        help="meshes to run, of memory,time,ideal (all; ideal needs memory's speeds)",
    )
    parser.add_argument(
        "--join-order",
        choices=("race", "slow-first", "fast-first"),
        default="race",
        help="placed meshes: the joiners start at once and race for the gap (race), or one places "
        "itself alone first: the slowed node (slow-first) or the other (fast-first)",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="R",
        help="after the three meshes, start each layout again with its ranges given, in R rounds "
        "side by side (the order turning), and compare those: a shared machine's load drifts "
        "over the minutes a placed mesh takes (0: off)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="keep the nodes' logs and data here (a temporary folder)"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/heterogeneous.py slows a node with a CPU cgroup: run it as root")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
