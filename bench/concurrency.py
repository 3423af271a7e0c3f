"""Many people at once: aggregate decode throughput and inter-token latency at concurrency 1, 2, 4, 8.

    python bench/concurrency.py [--tokens 32] [--rounds 2] [--prompt-tokens 32] [--threads 2]
                                [--levels 1,2,4,8] [--configs b,c,d] [--node-arg ARG ...]

Gemma 3 270M Q4_K_M, greedy, loopback, one machine, all in one run:

    (a)  monolithic llama-cpp-python answering the k requests one after another (one
         context, one sequence), in this process;
    (a') one llama.cpp context decoding the k sequences together, one token of each per
         ``llama_decode`` (each prompt prefilled on its own first): the limit of batching
         on this machine;
    (b)  one meshnode node serving all 18 layers;
    (c)  two nodes, [0, 9) and [9, 18);
    (d)  three nodes, [0, 6), [6, 12) and [12, 18);
    (dt) three nodes with a light tail, [0, 8), [8, 16) and [16, 18) (on Gemma the output
         matrix costs the tail more than all the layers; see bench/e2e.py).

``--configs`` names them, each optionally with node options of its own, ``KEY+OPTION=VALUE``:
``--configs d+pipeline=off,d+pipeline=on,dt+pipeline=on`` runs three meshes side by side in
the same alternating rounds (``--node-arg`` goes to every node of every mesh); and
``KEY+env.NAME=VALUE`` adds to one mesh's environment (``d+env.GOMP_SPINCOUNT=1000``).

Each mesh's nodes wait in OpenMP as suits them on this machine (bench/e2e.py's ``nodes_env``,
engines.openmp_wait): a short spin where they and the bench share the cores, libgomp's own
where each node has cores of its own; (a) and (a') run with this process's own setting.

(b)-(d) are real ``meshnode`` processes started once and left running; the bench streams
k ``/v1/completions`` requests at the same time to the first node's API, each with its own
prompt of token ids. Aggregate tokens/s = every request's completion tokens over the wall
time from sending the first request to the end of the last (prefills included, the same
for every configuration); inter-token latency = the gaps between one stream's successive
text chunks (one token each for ordinary text), p50 and p95 over all streams. Every
configuration runs each concurrency once per round, alternating, so load drifting on a
shared machine hits them alike; figures are medians over the rounds. Beside it, *steady*
decode tokens/s: the tokens that arrived while every stream was decoding (from the last
stream's first token to the first stream's last) over that time. The difference between
the two is what the prefills and the starts they stagger cost: k streams sent together
start decoding one after another, each behind the prefills before it.

Targets (issue 15): (d) at concurrency 4 >= 2.5x (d) at concurrency 1, and >= 0.7x (a') at k=4;
printed for every three-node configuration run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import (
    CONFIGS,
    OWN_OPENMP,
    Layout,
    Monolithic,
    describe_openmp,
    nodes_env,
    prepare_run,
    random_prompt,
    start_mesh,
)
from process_cpu import CpuSplit, cpu_reading, cpu_seconds, cpu_split_since

from engines.openmp_wait import available_cpus
from meshnode.app.local_mesh import LocalMesh
from meshnode.head.api_client import StreamSummary, TextChunk, stream_completion

TARGET_SCALING = 2.5  # (d)@4 over (d)@1
TARGET_VS_BATCHED = 0.7  # (d)@4 over (a')@4
# The three-node layouts of bench/e2e.py the targets are for: the even split and the light tail.
THREE_NODE_CONFIGS = ("d", "dt")
BATCHED = "a'"
BATCHED_LABEL = "(a')"


@dataclass(frozen=True)
class Trial:
    tokens: int
    wall_s: float
    # When each stream's tokens arrived (perf_counter seconds), one tuple per stream.
    arrivals: tuple[tuple[float, ...], ...]
    # CPU used during the trial: each node's (its event loop and its engine threads), and this
    # process's (the HTTP client of (b)-(d); all of (a) and (a')).
    cpu: Mapping[str, CpuSplit] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def gaps_s(self) -> tuple[float, ...]:
        """Inter-token latency: the gaps between one stream's successive tokens, all streams."""
        return tuple(b - a for stream in self.arrivals for a, b in itertools.pairwise(stream))

    @property
    def steady_tokens_per_s(self) -> float:
        """Decode tokens/s while every stream decodes: the tokens that arrived between the last
        stream's first token and the first stream's last, over that time. It leaves out what
        the aggregate figure counts besides decoding: the prefills, and the starts they stagger
        (a stream decoding alone while the others still prefill). Streams served one after
        another never decode together: for them (and for one stream) it is the decode tokens
        over the decoding time of each."""
        streams = [stream for stream in self.arrivals if len(stream) >= 2]
        if not streams:
            return float("nan")
        start = max(stream[0] for stream in streams)
        end = min(stream[-1] for stream in streams)
        if len(streams) > 1 and end > start:
            inside = sum(1 for stream in streams for at in stream if start < at <= end)
            return inside / (end - start)
        return sum(len(s) - 1 for s in streams) / sum(s[-1] - s[0] for s in streams)

    def cpu_ms_per_token(self, name: str, part: str = "total_s") -> float:
        return getattr(self.cpu[name], part) * 1000 / self.tokens


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ---------------------------------------------------------------------------- (a) and (a')


BENCH_PROCESS = "bench"


def with_cpu(trial: Trial, cpu: Mapping[str, CpuSplit]) -> Trial:
    return replace(trial, cpu=dict(cpu))


def in_process(run: Callable[..., Trial], *args: Any) -> Trial:
    """``run(*args)``, with the CPU this process used meanwhile."""
    before = cpu_seconds(os.getpid())
    trial = run(*args)
    return with_cpu(trial, {BENCH_PROCESS: CpuSplit(cpu_seconds(os.getpid()) - before, 0.0)})


async def across_nodes(mesh: LocalMesh, run: Awaitable[Trial]) -> Trial:
    """The trial ``run`` comes to, with the CPU each node and this process used meanwhile."""
    pids = {child.name: child.process.pid for child in mesh.children if child.alive()}
    nodes_before = {name: cpu_reading(pid) for name, pid in pids.items()}
    bench_before = cpu_seconds(os.getpid())
    trial = await run
    cpu = {name: cpu_split_since(pid, nodes_before[name]) for name, pid in pids.items()}
    cpu[BENCH_PROCESS] = CpuSplit(cpu_seconds(os.getpid()) - bench_before, 0.0)
    return with_cpu(trial, cpu)


def one_after_another(mono: Monolithic, prompts: list[list[int]], count: int) -> Trial:
    """(a): each request alone, the next one after it."""
    arrivals: list[tuple[float, ...]] = []
    started = time.perf_counter()
    for prompt in prompts:
        mono.lib.llama_memory_clear(mono.memory, True)
        token = mono._decode(prompt, 0)
        stream = [time.perf_counter()]
        for offset in range(count - 1):
            token = mono._decode([token], len(prompt) + offset)
            stream.append(time.perf_counter())
        arrivals.append(tuple(stream))
    return Trial(len(prompts) * count, time.perf_counter() - started, tuple(arrivals))


class MultiSequence:
    """(a'): one context, up to ``max_seqs`` sequences, one token of each per ``llama_decode``."""

    def __init__(
        self, path: Path, threads: int, weight_repack: bool, max_seqs: int, n_ctx_seq: int = 1024
    ) -> None:
        import llama_cpp

        from engines.llama_lib import ensure_llama_backend

        ensure_llama_backend()
        self.lib = llama_cpp
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = weight_repack
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx_seq * max_seqs
        ctx_params.n_batch = 512
        ctx_params.n_seq_max = max_seqs
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.memory = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, entries: list[tuple[int, list[int], int]]) -> list[int]:
        """``(seq_id, tokens, first_position)`` each; the greedy next token of each sequence."""
        batch = self.batch
        index = 0
        last_rows = []
        for seq_id, tokens, first in entries:
            for offset, token in enumerate(tokens):
                batch.token[index] = token
                batch.pos[index] = first + offset
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = seq_id
                batch.logits[index] = offset == len(tokens) - 1
                index += 1
            last_rows.append(index - 1)
        batch.n_tokens = index
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for row in last_rows:
            logits = np.ctypeslib.as_array(
                ctypes.cast(self.lib.llama_get_logits_ith(self.ctx, row), ctypes.POINTER(ctypes.c_float)),
                shape=(self.n_vocab,),
            )
            out.append(int(np.argmax(logits)))
        return out

    def run(self, prompts: list[list[int]], count: int) -> Trial:
        self.lib.llama_memory_clear(self.memory, True)
        started = time.perf_counter()
        tokens: list[int] = []
        streams: list[list[float]] = []
        for seq, prompt in enumerate(prompts):
            tokens.append(self._decode([(seq, prompt, 0)])[0])
            streams.append([time.perf_counter()])
        for offset in range(count - 1):
            tokens = self._decode([(seq, [tokens[seq]], len(p) + offset) for seq, p in enumerate(prompts)])
            now = time.perf_counter()
            for stream in streams:
                stream.append(now)
        arrivals = tuple(tuple(stream) for stream in streams)
        return Trial(len(prompts) * count, time.perf_counter() - started, arrivals)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


# ---------------------------------------------------------------------------- (b)-(d) meshnode


async def one_stream(api: str, prompt: list[int], count: int) -> tuple[int, tuple[float, ...]]:
    body = {"prompt": prompt, "max_tokens": count, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    arrivals: list[float] = []
    summary: StreamSummary | None = None
    async for event in stream_completion(api, "/v1/completions", body):
        if isinstance(event, TextChunk):
            arrivals.append(time.perf_counter())
        else:
            summary = event
    assert summary is not None
    return summary.completion_tokens, tuple(arrivals)


async def concurrent_streams(api: str, prompts: list[list[int]], count: int) -> Trial:
    started = time.perf_counter()
    done = await asyncio.gather(*(one_stream(api, prompt, count) for prompt in prompts))
    wall = time.perf_counter() - started
    return Trial(sum(tokens for tokens, _ in done), wall, tuple(arrivals for _, arrivals in done))


# ---------------------------------------------------------------------------- main


@dataclass(frozen=True)
class MeshConfig:
    """One entry of ``--configs``: ``KEY[+OPTION=VALUE...]``, a configuration of bench/e2e.py
    whose nodes also get ``--OPTION VALUE`` each (``d+pipeline=on+pipeline-cohorts=2``), or
    ``env.NAME=VALUE`` in their environment (``d+env.GOMP_SPINCOUNT=1000``), so that variants of
    one layout run side by side in the same alternating rounds."""

    name: str
    base: str
    node_args: tuple[str, ...]
    node_env: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return " ".join([CONFIGS[self.base][0], *self.node_args, *(f"{k}={v}" for k, v in self.node_env)])

    @property
    def layout(self) -> Layout:
        return CONFIGS[self.base][1]


ENV_OPTION = "env."


def parse_config(name: str) -> MeshConfig:
    base, *options = name.split("+")
    if base not in CONFIGS:
        raise SystemExit(f"--configs: unknown configuration {base!r} (one of {', '.join(CONFIGS)})")
    node_args: list[str] = []
    node_env: dict[str, str] = {}
    for option in options:
        flag, equals, value = option.partition("=")
        if not flag or not equals:
            raise SystemExit(f"--configs: {option!r} in {name!r} is not OPTION=VALUE")
        if flag.startswith(ENV_OPTION) and len(flag) > len(ENV_OPTION):
            node_env[flag[len(ENV_OPTION) :]] = value
        else:
            node_args += [f"--{flag}", value]
    return MeshConfig(name, base, tuple(node_args), tuple(node_env.items()))


def mesh_env(args: argparse.Namespace, config: MeshConfig) -> dict[str, str]:
    """The environment of ``config``'s nodes: bench/e2e.py's for a mesh of its size, then its own."""
    return {**nodes_env(args, len(config.layout)), **dict(config.node_env)}


@dataclass(frozen=True)
class RoutesOpened:
    """How a mesh's head ran the routes it opened (its /metrics): the mode a run measured."""

    in_cohorts: int
    in_one_batch: int
    last_cohorts: int

    def describe(self) -> str:
        last = f"{self.last_cohorts} cohorts" if self.last_cohorts else "one batch a stage"
        return f"routes opened in cohorts {self.in_cohorts}, in one batch a stage {self.in_one_batch}; last: {last}"


async def routes_opened(api: str) -> RoutesOpened:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{api}/metrics") as response:
        text = await response.text()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return RoutesOpened(
        round(samples[("meshnode_routes_opened_total", (("pipeline", "cohorts"),))]),
        round(samples[("meshnode_routes_opened_total", (("pipeline", "one_batch"),))]),
        round(samples[("meshnode_route_pipeline_cohorts", ())]),
    )


async def bench(
    args: argparse.Namespace, configs: list[MeshConfig], model: Path, prompts: list[list[int]]
) -> tuple[dict[tuple[str, int], list[Trial]], dict[str, RoutesOpened]]:
    keys = [config.name for config in configs]
    opened: dict[str, RoutesOpened] = {}
    levels = [int(level) for level in args.levels.split(",")]
    trials: dict[tuple[str, int], list[Trial]] = {}
    meshes: dict[str, LocalMesh] = {}
    apis: dict[str, str] = {}
    mono = Monolithic(model, args.threads, args.repack)
    multi = MultiSequence(model, args.threads, args.repack, max(levels))
    with contextlib.ExitStack() as stack:
        try:
            for index, config in enumerate(configs):
                key = config.name
                work = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix=f"meshnode-conc-{index}-"))
                )
                print(f"  starting {config.label}", file=sys.stderr, flush=True)
                env = mesh_env(args, config)
                print(f"  its nodes: {describe_openmp(env)}", file=sys.stderr, flush=True)
                mesh, apis[key] = await start_mesh(
                    work, model, config.layout, args.threads, env, extra=[*args.node_arg, *config.node_args]
                )
                meshes[key] = mesh
                await concurrent_streams(apis[key], prompts[:2], 8)  # warm: page faults, graphs, links
            one_after_another(mono, prompts[:1], 8)
            multi.run(prompts[:2], 8)
            for round_index in range(args.rounds):
                for level in levels:
                    chosen = prompts[:level]
                    trials.setdefault(("a", level), []).append(
                        in_process(one_after_another, mono, chosen, args.tokens)
                    )
                    trials.setdefault((BATCHED, level), []).append(in_process(multi.run, chosen, args.tokens))
                    for key in keys:
                        trial = await across_nodes(
                            meshes[key], concurrent_streams(apis[key], chosen, args.tokens)
                        )
                        trials.setdefault((key, level), []).append(trial)
                    line = ", ".join(
                        f"{k} {t[-1].tokens_per_s:.1f}" for (k, lv), t in trials.items() if lv == level
                    )
                    print(
                        f"  round {round_index + 1}, concurrency {level}: tok/s {line}",
                        file=sys.stderr,
                        flush=True,
                    )
            for key in keys:
                # The figures above must not be lost to a failed scrape: say so instead.
                try:
                    opened[key] = await routes_opened(apis[key])
                except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                    print(f"  {key}: could not read its head's /metrics: {exc!r}", file=sys.stderr)
        finally:
            for mesh in meshes.values():
                await asyncio.to_thread(mesh.stop_all)
            mono.close()
            multi.close()
    return trials, opened


def print_cpu(
    trials: dict[tuple[str, int], list[Trial]], labels: dict[str, str], levels: list[int], width: int
) -> None:
    """Where the cores went: CPU ms per generated token of each process, medians over rounds."""
    cores = available_cpus()
    print()
    print(f"CPU ms per generated token (medians over rounds): each node as event loop + engine threads, "
          f"'bench' = this process (all of (a) and (a'), the HTTP client of the meshes); 'ceiling' = "
          f"{cores} cores x 1000 / the sum, the tok/s these costs would allow if no core ever idled")  # fmt: skip
    for key in labels:
        for level in levels:
            runs = trials[(key, level)]
            names = list(runs[0].cpu)
            parts = []
            for name in names:
                if name == BENCH_PROCESS:
                    parts.append(f"{name} {statistics.median(t.cpu_ms_per_token(name) for t in runs):.2f}")
                else:
                    loop = statistics.median(t.cpu_ms_per_token(name, "main_s") for t in runs)
                    engine = statistics.median(t.cpu_ms_per_token(name, "others_s") for t in runs)
                    parts.append(f"{name} {loop:.2f}+{engine:.2f}")
            total = statistics.median(sum(t.cpu_ms_per_token(name) for name in names) for t in runs)
            print(f"{labels[key]:<{width}} {level:>3}  {', '.join(parts)}; sum {total:.2f}, "
                  f"ceiling {cores * 1000 / total:.0f} tok/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32, help="generated per request (32)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="threads of (a), (a') and of each node (2)")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrencies (1,2,4,8)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a GGUF of 18 or more layers instead of Gemma 3 270M Q4_K_M (the three-node splits are "
        "[0,6) [6,12) [12,18) and [0,8) [8,16) [16,18)); bench/cores_check.sh gives a generated one of Gemma's shape",
    )
    parser.add_argument(
        "--configs",
        default="b,c,d",
        help="meshnode configurations of bench/e2e.py, each KEY[+OPTION=VALUE...] (b,c,d)",
    )
    parser.add_argument(
        "--node-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="extra argument of every node (default: --max-sessions 8)",
    )
    parser.add_argument(
        "--node-env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="environment of the node processes and of (a), added to what meshnode demo sets",
    )
    args = parser.parse_args()
    if args.node_arg is None:
        args.node_arg = ["--max-sessions", "8"]
    # Before the model is prepared: a misspelt configuration fails at once.
    configs = [parse_config(name) for name in args.configs.split(",")]
    model = prepare_run(args)
    rng = np.random.default_rng(11)
    levels = [int(level) for level in args.levels.split(",")]
    prompts = [random_prompt(rng, args.prompt_tokens) for _ in range(max(levels))]
    trials, opened = asyncio.run(bench(args, configs, model, prompts))

    model_name = "Gemma 3 270M Q4_K_M" if args.model is None else model.name
    print(f"{model_name}, greedy, prompts of {args.prompt_tokens} tokens, {args.tokens} generated per request, "
          f"medians of {args.rounds} alternating rounds, {args.threads} threads per process; "
          f"weight repack {'on' if args.repack else 'off'}")  # fmt: skip
    waits = [f"{config.label}: {describe_openmp(mesh_env(args, config))}" for config in configs]
    print(f"OpenMP waiting: (a) and (a'): {describe_openmp(OWN_OPENMP)}; the nodes of {'; '.join(waits)}")
    labels = {"a": "(a) monolithic, one after another", BATCHED: f"{BATCHED_LABEL} one context, k per batch"}
    labels.update({config.name: config.label for config in configs})
    width = max(36, *(len(label) for label in labels.values()))
    print(f"{'configuration':<{width}} {'k':>3} {'tok/s':>8} {'vs k=1':>7} {'vs (a)':>7} {'vs ' + BATCHED_LABEL:>7} "
          f"{'ITL p50 ms':>11} {'ITL p95 ms':>11} {'steady':>8} {'vs k=1':>7} {'vs ' + BATCHED_LABEL:>7}")  # fmt: skip
    medians = {cell: statistics.median(t.tokens_per_s for t in runs) for cell, runs in trials.items()}
    steady = {cell: statistics.median(t.steady_tokens_per_s for t in runs) for cell, runs in trials.items()}
    for key in labels:
        for level in levels:
            gaps = [g for t in trials[(key, level)] for g in t.gaps_s]
            tps = medians[(key, level)]
            held = steady[(key, level)]
            print(f"{labels[key]:<{width}} {level:>3} {tps:>8.1f} {tps / medians[(key, levels[0])]:>6.2f}x "
                  f"{tps / medians[('a', level)]:>6.2f}x {tps / medians[(BATCHED, level)]:>6.2f}x "
                  f"{percentile(gaps, 50) * 1000:>11.1f} {percentile(gaps, 95) * 1000:>11.1f} "
                  f"{held:>8.1f} {held / steady[(key, levels[0])]:>6.2f}x {held / steady[(BATCHED, level)]:>6.2f}x")  # fmt: skip
    print(
        "(tok/s: every completion token over the wall time, prefills and staggered starts included; "
        "steady: decode tokens/s while every stream decodes, Trial.steady_tokens_per_s)"
    )
    print_cpu(trials, labels, levels, width)
    print()
    print("How each mesh's head ran its routes (its /metrics, warm-up included):")
    for config in configs:
        routes = opened.get(config.name)
        print(
            f"{config.label:<{width}} {routes.describe() if routes is not None else 'unknown (no /metrics read)'}"
        )
    if 4 not in levels or 1 not in levels:
        return
    for config in configs:
        if config.base not in THREE_NODE_CONFIGS:
            continue
        print()
        for figure, by in (("tok/s", medians), ("steady decode tok/s", steady)):
            scaling = by[(config.name, 4)] / by[(config.name, 1)]
            versus = by[(config.name, 4)] / by[(BATCHED, 4)]
            print(f"{config.label} at 4 over itself at 1 ({figure}): {scaling:.2f}x, target >= {TARGET_SCALING}x: "
                  f"{'met' if scaling >= TARGET_SCALING else 'MISSED'}")  # fmt: skip
            print(f"{config.label} at 4 over (a') at 4 ({figure}): {versus:.2f}x, target >= {TARGET_VS_BATCHED}x: "
                  f"{'met' if versus >= TARGET_VS_BATCHED else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
