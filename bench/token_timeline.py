"""Where one node's decode token goes (issue 54): a node serving the whole model, stamped per token.

Starts one ``meshnode`` node (``bench/e2e.py``'s machinery) on the random llama of
``bench/random_model.py --size small`` with ``bench/trace_hooks`` on its PYTHONPATH, speculation
off, streams ``--requests`` greedy completions of ``--tokens`` tokens through its API, stops it
and walks every decode token's stamps (one monotonic clock, ``trace_hooks/sitecustomize.py``):

    dec0   the head's driver starts a step (RouteDecoder.decode)
    frame  the shard worker receives the unit's frame (through the in-process link)
    e0     the engine thread starts the batch
    ll0    llama_decode is called            ll1  it returns
    s0     the tail samples                  s1   the token is drawn
    e1     the engine thread ends the batch
    back   the event loop takes the batch's result
    ans    the head's session client takes the answer frame
    dec1   the driver's step returns the token
    sse    the API writes the token's event
    dec0'  the next step starts

and prints the median and mean of each segment, per token, beside llama-bench's ms a token on
the same model and threads, measured after the node in the same run. ``--py-spy FILE`` also
samples the node with py-spy (if installed) during the requests and writes its raw stacks to FILE
with a summary of where the event loop's and the engine thread's samples fall.

    python bench/token_timeline.py [--requests 3] [--tokens 300] [--py-spy stacks.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e
import rpc_anchor
from overhead import small_prompt
from random_model import SIZES, ensure_random_model

HOOKS = Path(__file__).resolve().parent / "trace_hooks"
ORDER = ("dec0", "frame", "e0", "ll0", "ll1", "s0", "s1", "e1", "back", "ans", "dec1", "sse", "dec0'")
SEGMENTS = {
    ("dec0", "frame"): "driver + session + local link -> worker's frame",
    ("frame", "e0"): "worker -> engine thread starts (hand-off)",
    ("e0", "ll0"): "engine before llama_decode",
    ("ll0", "ll1"): "llama_decode",
    ("ll1", "s0"): "logits to the sampler",
    ("s0", "s1"): "sampling (the draw)",
    ("s1", "e1"): "engine after sampling",
    ("e1", "back"): "engine thread -> event loop (hand-off)",
    ("back", "ans"): "worker's answer -> local link -> head's client",
    ("ans", "dec1"): "head's client -> the step returns",
    ("dec1", "sse"): "driver yields -> text -> SSE chunk",
    ("sse", "dec0'"): "SSE write -> the next step starts",
}


def read_events(path: Path) -> list[tuple[int, str]]:
    events = []
    for line in path.read_text().splitlines():
        stamp, name, _ = line.split()
        events.append((int(stamp), name))
    events.sort()
    return events


def token_paths(
    events: list[tuple[int, str]], order: tuple[str, ...] = ORDER, gap_ms: float = 50.0
) -> list[dict[str, int]]:
    """Each decode token's stamps in ``order`` (its first name, primed, closes the cycle), for the
    tokens whose every stamp is there in order (the last token of a request has no next step, and
    a step whose text the API held back has no ``sse`` of its own: both are left out)."""
    by_name: dict[str, list[int]] = {}
    for stamp, name in events:
        by_name.setdefault(name, []).append(stamp)
    anchor = order[0]
    paths = []
    for start, following in itertools.pairwise(by_name.get(anchor, [])):
        if (following - start) / 1e6 > gap_ms:
            continue  # between requests
        path = {anchor: start}
        at = start
        for name in order[1:-1]:
            stamps = by_name.get(name, [])
            index = bisect.bisect_left(stamps, at)
            if index == len(stamps) or stamps[index] > following:
                break
            at = path[name] = stamps[index]
        else:
            path[order[-1]] = following
            paths.append(path)
    return paths


def report(events: list[tuple[int, str]], bench_ms: float | None, client_tps: list[float]) -> None:
    paths = token_paths(events)
    first, last = ORDER[0], ORDER[-1]
    print(f"one node, the whole model, speculation off: {len(paths)} decode tokens with every stamp")
    print(f"{'segment':<52} {'median ms':>10} {'mean ms':>9}")
    total_median = 0.0
    for (start, end), label in SEGMENTS.items():
        values = [(path[end] - path[start]) / 1e6 for path in paths]
        median = statistics.median(values)
        total_median += median
        print(f"{label:<52} {median:>10.3f} {statistics.mean(values):>9.3f}")
    whole = [(path[last] - path[first]) / 1e6 for path in paths]
    print(f"{'sum of the medians':<52} {total_median:>10.3f}")
    print(
        f"{'a whole token (one cycle)':<52} {statistics.median(whole):>10.3f} {statistics.mean(whole):>9.3f}"
    )
    outside = [((path[last] - path[first]) - (path["ll1"] - path["ll0"])) / 1e6 for path in paths]
    print(f"{'  of which outside llama_decode':<52} {statistics.median(outside):>10.3f} {statistics.mean(outside):>9.3f}")  # fmt: skip
    rates = ", ".join(f"{rate:.1f}" for rate in client_tps)
    print(f"the API client's decode tokens/s per request: {rates}")
    if bench_ms is not None:
        print(f"llama-bench on the same model and threads: {bench_ms:.3f} ms a token")


def summarize_stacks(path: Path, top: int = 25) -> None:
    """py-spy's raw stacks (``--format raw --threads``): per thread, its samples, and the frames
    holding the most of them (inclusive: a frame counts once per sample it is on the stack of)."""
    threads: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = {}
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0]
        threads[thread] += count
        seen = set()
        for frame in frames[1:]:
            name = frame.split(" (")[0] + " " + frame.rsplit("/", 1)[-1].split(":")[0]
            if name not in seen:
                seen.add(name)
                inclusive.setdefault(thread, Counter())[name] += count
    for thread, samples in threads.most_common(4):
        print(f"{thread}: {samples} samples")
        for name, count in inclusive[thread].most_common(top):
            print(f"  {100 * count / samples:5.1f}%  {name}")


async def run(
    args: argparse.Namespace, model: Path, prompt: list[int], trace_dir: Path
) -> tuple[int, list[float]]:
    env = e2e.nodes_env(args, 1)
    pythonpath = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": pythonpath, "MESHNODE_TRACE_DIR": str(trace_dir)})
    with tempfile.TemporaryDirectory(prefix="meshnode-token-timeline-") as work:
        mesh, api = await e2e.start_mesh(
            Path(work), model, [(None, False)], args.threads, env, extra=["--speculation", "off"]
        )
        try:
            pid = mesh.child("n0").process.pid
            await e2e.api_run(api, prompt, 8)  # warm
            spy = None
            if args.py_spy is not None:
                duration = max(2, round(args.requests * args.tokens * 0.006))
                spy = subprocess.Popen(
                    [args.py_spy_bin, "record", "--pid", str(pid), "--rate", "1000", "--threads",
                     "--nonblocking", "--format", "raw", "--duration", str(duration), "-o", str(args.py_spy)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                await asyncio.sleep(1.0)  # attached
            rates = []
            for _ in range(args.requests):
                summary = await e2e.api_greedy(api, prompt, args.tokens)
                rates.append(summary.decode_tokens_per_s)
            if spy is not None:
                await asyncio.to_thread(spy.wait)
            await asyncio.sleep(1.0)  # the hooks' last flush
        finally:
            await asyncio.to_thread(mesh.stop_all)
    return pid, rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--node-env", action="append", default=None, help="KEY=VALUE for the node")
    parser.add_argument("--py-spy", type=Path, default=None, help="also sample the node; raw stacks here")
    parser.add_argument("--no-bench", action="store_true", help="skip llama-bench's reference")
    args = parser.parse_args()
    args.py_spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args.model = ensure_random_model(args.size)
    model = e2e.prepare_run(args)
    prompt = small_prompt(np.random.default_rng(7), args.prompt_tokens, SIZES[args.size].n_vocab)
    with tempfile.TemporaryDirectory(prefix="meshnode-token-trace-") as trace_dir:
        pid, rates = asyncio.run(run(args, model, prompt, Path(trace_dir)))
        events = read_events(Path(trace_dir) / f"{pid}.trace")
    bench_ms = None
    if not args.no_bench:
        tools = rpc_anchor.cached_tools() or rpc_anchor.build_tools()
        settings = rpc_anchor.BenchSettings(
            model=model, threads=args.threads, tokens=args.tokens, depth=len(prompt), reps=3,
            repack=args.repack, env=e2e.nodes_env(args, 1),
        )  # fmt: skip
        tests, _ = rpc_anchor.run_bench_tests(tools, rpc_anchor.ANCHORS[rpc_anchor.BASELINE], [], settings)
        bench_ms = 1000 / rpc_anchor.decode_test(tests).avg_ts
    report(events, bench_ms, rates)
    if args.py_spy is not None and args.py_spy.exists():
        print()
        summarize_stacks(args.py_spy)


if __name__ == "__main__":
    main()
