"""Stages on machines of their own: does a three-stage route keep every stage busy (issue 15)?

    python bench/pipeline_overlap.py [--levels 1,2,3,4,6] [--tokens 24] [--rounds 2]
                                     [--fixed-ms 5.3] [--row-ms 2.3] [--stage-ms F,R/F,R/F,R]
                                     [--modes off,on,on:2]

On the 2-core machines here the nodes of bench/concurrency.py share the cores, so it cannot
show what a pipeline gains where each stage has a machine of its own (bench/cores_check.sh
measures that on the device machine's 16 cores when a session has one). This bench emulates
it: three real shard servers, a real head driver and the data plane's in-process loopback
mesh, with fake-engine stages whose engine batches take a fixed time by *sleeping*, so the
stages overlap on any number of cores. A batch of n sessions' decodes takes ``fixed + n x
row`` ms; the defaults are Gemma 3 270M's measured batch cost on this CPU (about 16 ms of
weight reading plus 7 ms a row for the whole model) split over three equal stages.

``--stage-ms`` gives each stage its own cost instead, e.g. the three real nodes measured on the
device machine's 16 cores, where the tail (the output layer over a 262 144-token vocabulary)
costs most and gains most from a batch (bench/RESULTS.md).

For each number k of concurrent generations, with the head's ``--pipeline off`` (every
ready session in one batch: the convoy), ``on`` (cohorts of floor(k / 3) a batch, one at least,
meshnode.dataplane.cohorts) and ``on:N`` (``--pipeline-cohorts N``: floor(k / N) a batch):
aggregate tokens/s, the share of the time all three stages computed at once, the share each
stage computed, and each stage's mean sessions per engine batch; then each mode over off, and each mode's tokens/s over its own
k = 1. Texts are checked against the whole fake model.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.loopback_routes import FAST, collect, reference, three_hop_routes
from helpers.recording_engine import RecordingEngine

from engines.interface import GREEDY, EngineError
from engines.sessioned_engine import BatchEntry, ForwardOutput
from meshnode.head.driver import DriverConfig, GenerationDriver

DEFAULT_MODES = "off,on"


class TimedStage(RecordingEngine):
    """A fake engine whose batches of n decodes sleep ``fixed_s + n * row_s`` (a prefill chunk:
    ``fixed_s`` plus a row a token), and record when they ran."""

    fixed_s = 0.0
    row_s = 0.0
    # Each stage's own (fixed_s, row_s), in route order, where --stage-ms gives them.
    stage_costs: tuple[tuple[float, float], ...] = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[float, float, int]] = []
        self._spans_lock = threading.Lock()

    def _timed(self, rows: int) -> tuple[float, float]:
        start = time.monotonic()
        time.sleep(self.fixed_s + rows * self.row_s)
        return start, time.monotonic()

    def _forward_batch(self, entries: Sequence[BatchEntry]) -> list[ForwardOutput | EngineError]:
        start, end = self._timed(len(entries))
        with self._spans_lock:
            self.spans.append((start, end, len(entries)))
        return super()._forward_batch(entries)


@dataclass
class Trial:
    tokens_per_s: float
    all_busy: float
    # Each stage's, in route order: the share of the wall time it computed, and its mean batch.
    stage_busy: tuple[float, ...]
    stage_batch: tuple[float, ...]


def all_busy_share(stages: list[list[tuple[float, float, int]]], wall_s: float) -> float:
    """The share of ``wall_s`` during which every stage was inside a batch."""
    edges = sorted({t for spans in stages for start, end, _ in spans for t in (start, end)})
    busy = 0.0
    for left, right in itertools.pairwise(edges):
        middle = (left + right) / 2
        if all(any(s <= middle < e for s, e, _ in spans) for spans in stages):
            busy += right - left
    return busy / wall_s


def parse_mode(mode: str) -> tuple[str, int]:
    """``off``, ``on``, ``auto`` or ``on:N`` (N cohorts) as (pipeline, pipeline_cohorts)."""
    pipeline, _, cohorts = mode.partition(":")
    return pipeline, int(cohorts) if cohorts else 0


async def trial(mode: str, k: int, tokens: int) -> Trial:
    pipeline, cohorts = parse_mode(mode)
    async with three_hop_routes(TimedStage, max_sessions=max(4, k)) as routes:
        for (fixed_s, row_s), shard in zip(TimedStage.stage_costs, routes.shards.values(), strict=False):
            shard.engine.fixed_s, shard.engine.row_s = fixed_s, row_s
        options = DriverConfig(
            **{**FAST.__dict__, "speculation": False, "pipeline": pipeline, "pipeline_cohorts": cohorts}
        )
        driver = GenerationDriver(routes, options)
        prompts = [[5 + i % 40, 3, 8, 1 + i // 40, 9] for i in range(k)]
        # The prefills first, then the decodes timed: tokens/s of decoding, as the other benches.
        engines = [shard.engine for shard in routes.shards.values()]
        started = time.monotonic()
        texts = await asyncio.gather(
            *(collect(driver.generate(routes.model, p, GREEDY, tokens)) for p in prompts)
        )
        wall = time.monotonic() - started
    for text, prompt in zip(texts, prompts, strict=True):
        if text != reference(prompt, tokens):
            raise SystemExit(f"pipeline {mode}, k={k}: a text differs from the whole model's")
    stages = [engine.spans for engine in engines]
    return Trial(
        k * tokens / wall,
        all_busy_share(stages, wall),
        tuple(sum(end - start for start, end, _ in spans) / wall for spans in stages),
        tuple(statistics.mean(n for _, _, n in spans) for spans in stages),
    )


async def bench(
    modes: list[str], levels: list[int], tokens: int, rounds: int
) -> dict[tuple[str, int], list[Trial]]:
    trials: dict[tuple[str, int], list[Trial]] = {(m, k): [] for m in modes for k in levels}
    for round_index in range(rounds):
        for k in levels:
            for mode in modes:
                trials[(mode, k)].append(await trial(mode, k, tokens))
        print(f"  round {round_index + 1} done", file=sys.stderr, flush=True)
    return trials


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,2,3,4,6", help="concurrent generations (1,2,3,4,6)")
    parser.add_argument("--tokens", type=int, default=24, help="generated per request (24)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fixed-ms", type=float, default=5.3, help="a stage's batch: fixed part (5.3)")
    parser.add_argument("--row-ms", type=float, default=2.3, help="a stage's batch: per session (2.3)")
    parser.add_argument(
        "--stage-ms",
        default="",
        help="each stage's own FIXED,ROW ms, stages separated by '/' (overrides --fixed-ms and --row-ms)",
    )
    parser.add_argument("--modes", default=DEFAULT_MODES, help="off, on, auto, on:N (N cohorts); (off,on)")
    args = parser.parse_args()
    TimedStage.fixed_s = args.fixed_ms / 1000
    TimedStage.row_s = args.row_ms / 1000
    if args.stage_ms:
        TimedStage.stage_costs = tuple(
            (float(fixed) / 1000, float(row) / 1000)
            for fixed, row in (stage.split(",") for stage in args.stage_ms.split("/"))
        )
    modes = args.modes.split(",")
    for mode in modes:
        parse_mode(mode)
    levels = [int(level) for level in args.levels.split(",")]
    trials = asyncio.run(bench(modes, levels, args.tokens, args.rounds))

    def median(mode: str, k: int, field: str) -> float:
        return statistics.median(getattr(t, field) for t in trials[(mode, k)])

    def per_stage(mode: str, k: int, field: str, form: str) -> str:
        columns = zip(*(getattr(t, field) for t in trials[(mode, k)]), strict=True)
        return "/".join(format(statistics.median(column), form) for column in columns)

    costs = (
        args.stage_ms.replace("/", " | ") + " (fixed,row ms per stage)"
        if args.stage_ms
        else f"{args.fixed_ms:g} + n x {args.row_ms:g} ms each"
    )
    print(f"three sleep-timed stages (a batch of n: {costs}), real servers "
          f"and head over the in-process loopback mesh, {args.tokens} tokens per generation (prefill "
          f"included), medians of {args.rounds} rounds")  # fmt: skip
    print(
        f"{'k':>3} {'pipeline':>8} {'tok/s':>8} {'vs k=1':>7} {'all 3 busy':>11} {'busy per stage':>15} "
        f"{'sessions/batch':>15} {'vs off':>7}"
    )
    for k in levels:
        for mode in modes:
            tps = median(mode, k, "tokens_per_s")
            ratio = (
                f"{tps / median('off', k, 'tokens_per_s'):>6.2f}x" if mode != "off" and "off" in modes else ""
            )
            print(f"{k:>3} {mode:>8} {tps:>8.1f} {tps / median(mode, levels[0], 'tokens_per_s'):>6.2f}x "
                  f"{median(mode, k, 'all_busy'):>10.0%} {per_stage(mode, k, 'stage_busy', '.0%'):>15} "
                  f"{per_stage(mode, k, 'stage_batch', '.2f'):>15} {ratio:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
