"""Where a decode token's time goes between one node's engine and the next (issue 20).

Starts the (d) mesh of ``bench/e2e.py`` (three node processes, layers [0,6) [6,12) [12,18)) with
``bench/trace_hooks`` on every node's PYTHONPATH, so each node stamps its UDP datagrams, the frames
its shard worker receives, and each engine batch's start, end and return to the event loop (see
``trace_hooks/sitecustomize.py``). It streams ``--requests`` greedy completions through the API, one
after another, stops the nodes, merges their stamps (one monotonic clock for all processes) and
walks each decode token's critical path: n0's engine, the hop to n1, n1's engine, the hop to n2,
n2's engine (with the vocabulary projection and the draw), the answer to the head in n0 and the
head's next step. Each hop is split into:

- ``back``: the engine thread's result reaching the event loop;
- ``to send``: from there to the first datagram out (worker bookkeeping, encoding, QUIC packets);
- ``wire``: the first datagram out to the first one in at the next node (kernel, scheduling);
- ``datagrams``: first to last datagram in before the frame;
- ``to frame``: the last datagram in to the shard worker's frame (QUIC receive, stream reader,
  framing; for the answer to the head also the head's driver and its loopback step);
- ``to engine``: the frame to the engine's start (parse, validate, schedule, engine-thread wake).

Medians over every decode token of every request. Speculation is off (one token a step). The
baseline, measured after the mesh in the same run: the same three slices chained in this one
process (``LlamaShardEngine``, hidden states handed over in memory); each node's engine time is
printed against its slice's, so what the processes cost the compute shows beside the hops.

    python bench/hop_timeline.py [--requests 6] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e
from engine import load_chain, prefill_seconds

from engines.interface import GREEDY, SessionKey, StepRequest

HOOKS = Path(__file__).resolve().parent / "trace_hooks"
SMALL_DATAGRAM = 120
SEGMENTS = ("back", "to send", "wire", "datagrams", "to frame", "to engine")


@dataclass
class NodeTrace:
    name: str
    engine: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each batch
    back: list[int] = field(default_factory=list)
    tx: list[int] = field(default_factory=list)
    rx: list[int] = field(default_factory=list)
    # Every datagram in or out, with its size: what a process does while another computes.
    datagrams: list[tuple[int, int]] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)


def read_trace(name: str, path: Path) -> NodeTrace:
    trace = NodeTrace(name)
    started: int | None = None
    for line in path.read_text().splitlines():
        stamp, event, detail = line.split()
        t = int(stamp)
        if event in ("tx", "rx"):
            trace.datagrams.append((t, int(detail)))
        if event == "e0":
            started = t
        elif event == "e1" and started is not None:
            trace.engine.append((started, t))
            started = None
        elif event == "back":
            trace.back.append(t)
        elif event == "tx":
            trace.tx.append(t)
        elif event == "rx":
            trace.rx.append(t)
        elif event == "frame":
            trace.frames.append(t)
    for stamps in (trace.back, trace.tx, trace.rx, trace.frames):
        stamps.sort()
    trace.engine.sort()
    trace.datagrams.sort()
    return trace


def first_after(stamps: list[int], t: int) -> int | None:
    i = bisect.bisect_right(stamps, t)
    return stamps[i] if i < len(stamps) else None


def last_before(stamps: list[int], t: int) -> int | None:
    i = bisect.bisect_left(stamps, t)
    return stamps[i - 1] if i > 0 else None


def hop_segments(src: NodeTrace, dst: NodeTrace, src_end: int, dst_start: int) -> dict[str, float] | None:
    """The segments of one hop, in ms, or None when a stamp is missing in the window."""
    back = first_after(src.back, src_end)
    sent = first_after(src.tx, back) if back is not None else None
    arrived = first_after(dst.rx, sent) if sent is not None else None
    frame = last_before(dst.frames, dst_start)
    last_in = last_before(dst.rx, frame) if frame is not None else None
    stamps = [src_end, back, sent, arrived, last_in, frame, dst_start]
    known = [s for s in stamps if s is not None]
    if len(known) < len(stamps) or sorted(known) != known:
        return None
    deltas = [(b - a) / 1e6 for a, b in itertools.pairwise(known)]
    return dict(zip(SEGMENTS, deltas, strict=True))


def critical_paths(traces: list[NodeTrace]) -> tuple[list[list[float]], list[dict[str, list[float]]]]:
    """Per node, its decode engine times; per hop (n0->n1, n1->n2, n2->n0), its segments."""
    runs = sorted((start, end, index) for index, trace in enumerate(traces) for start, end in trace.engine)
    count = len(traces)
    engine_ms: list[list[float]] = [[] for _ in traces]
    hops: list[dict[str, list[float]]] = [{name: [] for name in (*SEGMENTS, "total")} for _ in traces]
    for (start, end, index), (next_start, _, next_index) in itertools.pairwise(runs):
        if next_index != (index + 1) % count:
            continue  # a prefill's other chunks, a request's end
        gap_ms = (next_start - end) / 1e6
        if gap_ms > 50:
            continue  # between requests
        engine_ms[index].append((end - start) / 1e6)
        segments = hop_segments(traces[index], traces[next_index], end, next_start)
        if segments is None:
            continue
        for name, value in segments.items():
            hops[index][name].append(value)
        hops[index]["total"].append(gap_ms)
    return engine_ms, hops


async def run(args: argparse.Namespace, model: Path, prompt: list[int], trace_dir: Path) -> list[NodeTrace]:
    env = e2e.nodes_env(args, len(e2e.THREE))
    env.update({"PYTHONPATH": str(HOOKS), "MESHNODE_TRACE_DIR": str(trace_dir)})
    with tempfile.TemporaryDirectory(prefix="meshnode-timeline-") as work:
        mesh, api = await e2e.start_mesh(
            Path(work), model, e2e.THREE, args.threads, env, extra=["--speculation", "off"]
        )
        try:
            names = [f"n{i}" for i in range(len(e2e.THREE))]
            pids = {mesh.child(name).process.pid: name for name in names}
            await e2e.api_run(api, prompt, 8)  # warm
            rates = [(await e2e.api_run(api, prompt, args.tokens)).decode_tps for _ in range(args.requests)]
            print(f"  decode tok/s per request: {', '.join(f'{r:.1f}' for r in rates)}", file=sys.stderr)
            await asyncio.sleep(1.0)  # the last flush
        finally:
            await asyncio.to_thread(mesh.stop_all)
    traces = {name: NodeTrace(name) for name in pids.values()}
    for path in trace_dir.glob("*.trace"):
        name = pids.get(int(path.stem))
        if name is not None:
            traces[name] = read_trace(name, path)
    return [traces[name] for name in sorted(traces)]


def datagrams_during(traces: list[NodeTrace], engine_runs: int = 400) -> list[list[tuple[float, float]]]:
    """For each node's engine runs, the median count of datagrams every node sent or received
    meanwhile, as (small, large): small ones (ACKs, credits, Acks; at most SMALL_DATAGRAM bytes)
    are what wakes an idle process, or the computing one's own event loop, while it computes."""
    table = []
    for computing in traces:
        row = []
        for other in traces:
            stamps = [t for t, _ in other.datagrams]
            small, large = [], []
            for start, end in computing.engine[-engine_runs:]:
                window = other.datagrams[bisect.bisect_left(stamps, start) : bisect.bisect_right(stamps, end)]
                small.append(sum(1 for _, size in window if size <= SMALL_DATAGRAM))
                large.append(sum(1 for _, size in window if size > SMALL_DATAGRAM))
            row.append((statistics.mean(small), statistics.mean(large)) if small else (0.0, 0.0))
        table.append(row)
    return table


def in_process_ms(model: Path, threads: int, prompt: list[int], tokens: int, rounds: int) -> list[float]:
    """The baseline, same run: the same three slices chained in this one process, median ms of
    each slice's decode step (its hidden state handed over in memory)."""
    chain = load_chain(str(model), (0, 6, 12, 18), threads, 0, False)
    times: list[list[float]] = [[] for _ in chain]
    for round_index in range(rounds):
        key = SessionKey(f"baseline-{round_index}", 1)
        _, token = prefill_seconds(chain, key, tuple(prompt))
        for position in range(len(prompt), len(prompt) + tokens):
            hidden = None
            for index, engine in enumerate(chain):
                tail = index == len(chain) - 1
                request = StepRequest(key, position, token_ids=None if index else (token,), hidden=hidden,
                                      expected_past_len=position, sampling=GREEDY if tail else None)  # fmt: skip
                started = time.perf_counter()
                result = engine.decode(request)
                times[index].append((time.perf_counter() - started) * 1000)
                hidden = result.hidden
            assert result.token_id is not None
            token = result.token_id
        for engine in chain:
            engine.release(key)
    for engine in chain:
        engine.close()
    return [statistics.median(t) for t in times]


def report(traces: list[NodeTrace], baseline_ms: list[float]) -> None:
    engine_ms, hops = critical_paths(traces)
    names = [trace.name for trace in traces]
    print(f"{'segment':<34}{'ms (median)':>12}{'tokens':>8}{'in-process ms':>15}{'ratio':>8}")
    total = 0.0
    for index, name in enumerate(names):
        nxt = names[(index + 1) % len(names)]
        if engine_ms[index]:
            value = statistics.median(engine_ms[index])
            total += value
            alone = baseline_ms[index]
            print(
                f"{name + ' engine':<34}{value:>12.2f}{len(engine_ms[index]):>8}{alone:>15.2f}{value / alone:>7.2f}x"
            )
        hop = hops[index]
        if hop["total"]:
            for segment in SEGMENTS:
                print(
                    f"{'  ' + name + ' -> ' + nxt + ': ' + segment:<34}{statistics.median(hop[segment]):>12.2f}"
                )
            value = statistics.median(hop["total"])
            total += value
            print(f"{name + ' -> ' + nxt + ' (whole hop)':<34}{value:>12.2f}{len(hop['total']):>8}")
    print(
        f"{'sum of medians':<34}{total:>12.2f}{'':>8}{sum(baseline_ms):>15.2f}{total / sum(baseline_ms):>7.2f}x"
    )
    print("(in-process: the same slices chained in this process, same run; its sum has no hops)")
    print()
    print("datagrams in and out of each node while one computes (mean per engine run, small/large):")
    print(f"{'computing':<12}" + "".join(f"{name:>14}" for name in names))
    for name, row in zip(names, datagrams_during(traces), strict=True):
        print(f"{name:<12}" + "".join(f"{small:>8.2f}/{large:<5.2f}" for small, large in row))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--node-env", action="append", default=None, help="KEY=VALUE for every node")
    parser.add_argument("--keep", type=Path, help="write the nodes' trace files here and keep them")
    args = parser.parse_args()
    model = e2e.prepare_run(args)
    prompt = e2e.random_prompt(np.random.default_rng(7), args.prompt_tokens)
    with tempfile.TemporaryDirectory(prefix="meshnode-trace-") as scratch:
        trace_dir = args.keep or Path(scratch)
        trace_dir.mkdir(parents=True, exist_ok=True)
        traces = asyncio.run(run(args, model, prompt, trace_dir))
    report(traces, in_process_ms(model, args.threads, prompt, args.tokens, rounds=args.requests))


if __name__ == "__main__":
    main()
