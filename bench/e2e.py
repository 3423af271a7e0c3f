"""End to end: what a person gets from meshnode's API against llama.cpp run directly, same run.

    python bench/e2e.py [--tokens 32] [--rounds 6] [--prompt-tokens 96] [--threads 2]
                        [--configs b,c,d,e] [--no-breakdown] [--node-env KEY=VALUE]
                        [--delay-ms 10 --delay-ms 20] [--rpc] [--rpc-reps 3]

Gemma 3 270M Q4_K_M, greedy, loopback, one machine:

    (a)  monolithic llama-cpp-python through its low-level API (llama_decode on a batch,
         argmax over the last position's logits), ``--threads`` threads, in this process;
    (b)  meshnode, one node serving all 18 layers;
    (c)  two nodes, [0, 9) and [9, 18);
    (d)  three nodes, [0, 6), [6, 12) and [12, 18);
    (dt) three nodes with a light tail, [0, 8), [8, 16) and [16, 18): stages of more alike
         cost, the output matrix being the tail's, as ``meshnode split --nodes 3`` gives them
         (for bench/concurrency.py's pipelines);
    (e)  two nodes through a relay: the second node is "behind NAT" (--relay-only
         --not-directly-reachable), so every activation and token crosses the relay;
    (c1), (d1): (c) and (d) with one compute thread per node instead of ``--threads``;
    (d+N ms), one per ``--delay-ms N``: (d) with N ms of added one-way delay between every two
         nodes: each node listens behind a UDP delay proxy (tests/helpers/delay_proxy.py, all
         of a configuration in one child process) and advertises the proxy's port, so every
         datagram between nodes, either way, waits N ms (a round trip of 2N ms).

(b)–(e) are real ``meshnode`` processes (``meshnode start``/``join`` with an invite, a
``meshnode relay`` for (e)), all started first and left running; the bench process is an
HTTP client of each first node's OpenAI-compatible API and streams ``/v1/completions``
(the prompt given as token ids, so every configuration prefills the same tokens). Time
to first token = request sent to the first streamed text; decode tokens/s = tokens after
the first over the time after the first. Configurations alternate, one generation each
per round, so load drifting on a shared machine hits them alike; figures are medians
over the rounds, ratios are against (a) from the same rounds.

The answer's way back (``--no-answer-paths`` skips it): on (d) and every (d+N ms), the bench
process joins the mesh as a client node and decodes through one chained session A -> B -> C,
alternately with the tail's token relayed back through every stage (C -> B -> A -> client,
the way before issue 20) and with the tail answering the client directly on an answer stream
(C -> client); it prints both median decode round trips from the same processes and rounds.

The anchor (``--rpc``, or any of ``rpc1,rpc2,rpc3`` in ``--configs``; issue 20): llama.cpp's own RPC
split on the same model file, in the same rounds, by ``llama-bench`` and ``ggml-rpc-server`` built from
the pinned llama-cpp-python sdist's vendored llama.cpp (``bench/build_llama_rpc.sh``, cached under
``~/.cache/meshnode/llama-rpc/``; built on first use, minutes). Each round runs, after (a)–(e):

    (rpc1) ``llama-bench -ngl 0``, no RPC: the anchor's own baseline;
    (rpc2) 2-way, one ggml-rpc-server: ``--rpc 127.0.0.1:P -ngl 10``: llama.cpp counts the output
           layer as a 19th and offloads from the top, so the server holds blocks 9–17 and the output
           layer, the process 0–8: (c)'s split;
    (rpc3) 3-way, two servers: ``-ngl 13 -ts 6/7``: 0–5 local, 6–11 on the first server, 12–17 and the
           output layer on the second: (d)'s split;

each a decode-only test (``-p 0 -n --tokens -d --prompt-tokens -r --rpc-reps -o json``), every process
with ``--threads`` threads and the three-node mesh's environment (``nodes_env``). A verbose run of each
split first checks llama.cpp's load log for the offloaded layers and a model buffer on every server.
The table gives each split's decode tokens/s, its ratio against rpc1 and its added ms/token
(1000/tps − 1000/tps_rpc1), beside (c) and (d) against (a), and the issue's target: (d)'s added
ms/token at most twice the 3-way split's. The servers are stopped however the bench ends.

Where the time goes (on the three-node mesh; ``--no-breakdown`` skips it): the bench process joins
the mesh with an invite as a client node and drives each hop on its own — a session
to A with the prompt's tokens, to B with A's hidden states, to C with B's — then
decode steps the same way. Per hop: the engine's own time for the step (the worker's
``Ack.execution_nanos``) and the round trip seen by the caller; the difference is what
one hop costs beyond computing (QUIC both ways, the data plane, the engine thread hop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# bench/ itself, for rpc_anchor when this module is imported rather than run (bench/concurrency.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rpc_anchor
from one_sequence_batch import fill_one_sequence

from engines.default_model import default_model_path
from engines.engine_guard import choose_weight_repack
from engines.engine_probe import ProbeTarget
from engines.openmp_wait import available_cpus, openmp_wait_env
from engines.weight_repack import WeightRepack
from meshnode.app.local_mesh import LocalMesh
from meshnode.head.api_client import StreamSummary, stream_completion
from meshnode.wire.pb import shard
from tests.helpers.delay_proxy import free_udp_port

# How (a) waits in OpenMP: libgomp read this process's environment when llama.cpp loaded above.
OWN_OPENMP = {name: value for name in ("GOMP_SPINCOUNT",) if (value := os.environ.get(name)) is not None}

if TYPE_CHECKING:
    from meshnode.node import Node

Layout = list[tuple[tuple[int, int] | None, bool]]
TWO: Layout = [((0, 9), False), ((9, 18), False)]
THREE: Layout = [((0, 6), False), ((6, 12), False), ((12, 18), False)]
# Three nodes whose stages cost more alike: on Gemma 3 270M the tail's output matrix (262 144
# tokens x 640) costs more than all 18 layers together, so an even split of the layers leaves
# the tail the slowest stage by far; a pipeline of stages on machines of their own runs at the
# pace of its slowest. These are the ranges `meshnode split --nodes 3` prints for Gemma
# (meshnode/autoplace/stage_balance.py; bench/RESULTS.md, "A light tail").
LIGHT_TAIL: Layout = [((0, 8), False), ((8, 16), False), ((16, 18), False)]
# key: (label, layout, threads per node or None for --threads)
CONFIGS: dict[str, tuple[str, Layout, int | None]] = {
    "b": ("(b) 1 node", [(None, False)], None),
    "c": ("(c) 2 nodes", TWO, None),
    "d": ("(d) 3 nodes", THREE, None),
    "dt": ("(dt) 3 nodes, light tail", LIGHT_TAIL, None),
    "e": ("(e) 2 nodes through the relay", [((0, 9), False), ((9, 18), True)], None),
    "c1": ("(c1) 2 nodes, 1 thread each", TWO, 1),
    "d1": ("(d1) 3 nodes, 1 thread each", THREE, 1),
}
TARGETS = {"c": 0.85, "d": 0.80, "c1": 0.85, "d1": 0.80}


# Configurations run behind delay proxies: key -> added one-way delay in ms (from --delay-ms).
DELAYS_MS: dict[str, float] = {}
# Filled by bench(): per three-node configuration, the answer's way back (--answer-paths).
ANSWER_PATHS: dict[str, AnswerPaths] = {}
# Filled by bench() for the llama.cpp RPC anchor (--rpc): per anchor key, each round's decode
# tokens/s (llama-bench's mean over --rpc-reps), and where the load log put the layers.
ANCHOR_RUNS: dict[str, list[float]] = {}
ANCHOR_PLACEMENT: dict[str, str] = {}


def delayed_key(delay_ms: float) -> str:
    return f"d+{delay_ms:g}ms"


class DelayProxies:
    """One UDP delay proxy per node of a configuration, all in one child process (so that nothing
    holding this process's GIL — its HTTP client, its own QUIC node — holds a datagram back)."""

    def __init__(self, delay_ms: float, nodes: int) -> None:
        import subprocess

        self._node_ports = [free_udp_port() for _ in range(nodes)]
        script = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "delay_proxy.py"
        targets = [arg for port in self._node_ports for arg in ("--target", f"127.0.0.1:{port}")]
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--delay-ms", str(delay_ms), *targets],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if not line or line[0] != "ports":
            raise RuntimeError("the delay proxies did not start")
        self._proxy_ports = [int(port) for port in line[1:]]
        self._next = 0

    def node_args(self) -> list[str]:
        """Arguments for the next node: it listens on its port behind its proxy, which it advertises."""
        index = self._next
        self._next += 1
        node_port, proxy_port = self._node_ports[index], self._proxy_ports[index]
        return ["--listen", f"127.0.0.1:{node_port}", "--advertise", f"127.0.0.1:{proxy_port}"]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@dataclass(frozen=True)
class Run:
    ttft_s: float
    decode_tps: float
    tokens: int


def median_run(runs: list[Run]) -> Run:
    return Run(
        statistics.median(r.ttft_s for r in runs),
        statistics.median(r.decode_tps for r in runs),
        min(r.tokens for r in runs),
    )


# ---------------------------------------------------------------------------- (a) monolithic


MONOLITHIC_BATCH = 512


class Monolithic:
    """llama-cpp-python's low-level API: one context, one sequence, greedy."""

    def __init__(
        self, path: Path, threads: int, weight_repack: bool, n_ctx: int = 1024, n_gpu_layers: int = 0
    ) -> None:
        # Imported late: libgomp reads its settings (see --node-env) when llama.cpp loads.
        import llama_cpp

        from engines.llama_lib import ensure_llama_backend

        ensure_llama_backend()
        self.lib = llama_cpp
        params = self.lib.llama_model_default_params()
        # The nodes' setting (the probe's choice), not llama.cpp's default: on an AMX CPU the
        # default repacks weights and the pinned build dies in its first decode.
        params.use_extra_bufts = weight_repack
        params.n_gpu_layers = n_gpu_layers
        self.model = self.lib.llama_model_load_from_file(str(path).encode(), params)
        ctx_params = self.lib.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = MONOLITHIC_BATCH
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        self.ctx = self.lib.llama_init_from_model(self.model, ctx_params)
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        self.batch = self.lib.llama_batch_init(MONOLITHIC_BATCH, 0, 1)
        self.memory = self.lib.llama_get_memory(self.ctx)

    def _decode(self, tokens: list[int], first_position: int) -> int:
        # A prompt longer than the batch (bench/big_model.py's 1024 and 4096 tokens) goes in
        # batch-sized pieces, as llama.cpp's own tools feed it; the logits are the last piece's.
        for start in range(0, len(tokens), MONOLITHIC_BATCH):
            fill_one_sequence(self.batch, tokens[start : start + MONOLITHIC_BATCH], first_position + start)
            if self.lib.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(
            ctypes.cast(self.lib.llama_get_logits_ith(self.ctx, -1), ctypes.POINTER(ctypes.c_float)),
            shape=(self.n_vocab,),
        )
        return int(np.argmax(logits))

    def run(self, prompt: list[int], count: int) -> Run:
        self.lib.llama_memory_clear(self.memory, True)
        started = time.perf_counter()
        token = self._decode(prompt, 0)
        first = time.perf_counter()
        for offset in range(count - 1):
            token = self._decode([token], len(prompt) + offset)
        end = time.perf_counter()
        return Run(first - started, (count - 1) / (end - first), count)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


# ---------------------------------------------------------------------------- (b)-(e) meshnode


async def api_greedy(api: str, prompt: list[int], tokens: int) -> StreamSummary:
    """One greedy streamed /v1/completions of ``prompt`` (token ids): what the stream came to."""
    return await api_completion(api, prompt, tokens, {"temperature": 0})


async def api_completion(
    api: str, prompt: list[int], tokens: int, sampling: dict[str, float | int]
) -> StreamSummary:
    """One streamed /v1/completions of ``prompt`` (token ids) with ``sampling`` (temperature,
    seed, ...): what the stream came to."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}  # fmt: skip
    summary: StreamSummary | None = None
    async for event in stream_completion(api, "/v1/completions", body):
        if isinstance(event, StreamSummary):
            summary = event
    assert summary is not None
    return summary


async def api_run(api: str, prompt: list[int], tokens: int) -> Run:
    summary = await api_greedy(api, prompt, tokens)
    return Run(summary.time_to_first_token_s, summary.decode_tokens_per_s, summary.completion_tokens)


async def start_mesh(
    work: Path,
    model: Path,
    layout: Layout,
    threads: int,
    env: dict[str, str],
    *,
    extra: Sequence[str] = (),
    proxies: DelayProxies | None = None,
    ctx: int = 1024,
) -> tuple[LocalMesh, str]:
    """The configuration's processes, ready (its API lists the model), ``extra`` arguments given to
    each (and each behind a delay proxy of ``proxies``), ``ctx`` tokens per session; returns the API
    URL."""
    # The nodes' own gossip timing, as a user's mesh runs: LocalMesh's default is the tests'
    # one-second heartbeat (failures seen fast), which costs every node ~6 ms of CPU a second
    # more, ~0.45 ms a token over three nodes at 40 tokens/s, on the cores the engines share.
    mesh = LocalMesh(work, model, threads=threads, ctx=ctx, env=env, timing=())

    def node_extra() -> list[str]:
        return [*extra, *(proxies.node_args() if proxies is not None else [])]

    mesh.create_mesh("n0")
    if any(nat for _, nat in layout):
        await mesh.start_relay()
    await mesh.start_first("n0", layout[0][0], extra=node_extra())
    if len(layout) > 1:
        token = mesh.invite("n0")
        joining = [
            mesh.join(f"n{i}", layers, token, behind_nat=nat, extra=node_extra())
            for i, (layers, nat) in enumerate(layout[1:], start=1)
        ]
        for child in joining:
            await mesh.wait_serving(child)
    api, _ = await mesh.wait_route("n0")
    return mesh, api


async def bench(
    args: argparse.Namespace, model: Path, prompt: list[int]
) -> tuple[dict[str, list[Run]], tuple[list[HopTiming], float]]:
    keys = args.mesh_configs + [delayed_key(ms) for ms in args.delay_ms]
    runs: dict[str, list[Run]] = {key: [] for key in ["a", *keys]}
    anchors = [rpc_anchor.ANCHORS[key] for key in args.anchor_configs]
    anchor_settings = rpc_anchor.BenchSettings(
        model=model,
        threads=args.threads,
        tokens=args.tokens,
        depth=len(prompt),
        reps=args.rpc_reps,
        repack=args.repack,
        env=nodes_env(args, 3),
    )
    endpoints: list[str] = []
    meshes: dict[str, LocalMesh] = {}
    hops: tuple[list[HopTiming], float] = ([], 0.0)
    paths = ANSWER_PATHS
    apis: dict[str, str] = {}
    mono = Monolithic(model, args.threads, args.repack)
    with contextlib.ExitStack() as stack:
        try:
            for key in keys:
                label, layout, threads = CONFIGS[key]
                work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"meshnode-e2e-{key}-")))
                print(f"  starting {label}", file=sys.stderr, flush=True)
                env = nodes_env(args, len(layout))
                print(f"  its nodes: {describe_openmp(env)}", file=sys.stderr, flush=True)
                proxies = None
                if key in DELAYS_MS:
                    proxies = DelayProxies(DELAYS_MS[key], len(layout))
                    stack.callback(proxies.close)
                mesh, apis[key] = await start_mesh(
                    work,
                    model,
                    layout,
                    threads or args.threads,
                    env,
                    extra=["--speculation", args.speculation],
                    proxies=proxies,
                )
                meshes[key] = mesh
                await api_run(apis[key], prompt, 8)  # warm: page faults, graph allocation, links
            if anchors:
                # Started on this (the event loop's) thread: the servers' parent-death signal is
                # tied to the thread that forked them, and this one lives as long as the bench.
                logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshnode-e2e-rpc-")))
                count = max(config.servers for config in anchors)
                print(f"  starting {count} ggml-rpc-server(s)", file=sys.stderr, flush=True)
                servers = stack.enter_context(
                    rpc_anchor.RpcServers(args.rpc_tools, count, args.threads, anchor_settings.env, logs)
                )
                endpoints = servers.endpoints
                for config in anchors:
                    # One verbose run each: the layer check, and the warm-up the others get above.
                    _, log = await asyncio.to_thread(
                        rpc_anchor.run_bench, args.rpc_tools, config, endpoints[: config.servers],
                        anchor_settings, verbose=True,
                    )  # fmt: skip
                    if config.servers:
                        placement = rpc_anchor.parse_placement(log)
                        ANCHOR_PLACEMENT[config.key] = rpc_anchor.check_placement(
                            config, placement, endpoints[: config.servers]
                        )
                        print(
                            f"  {config.label}: {ANCHOR_PLACEMENT[config.key]}", file=sys.stderr, flush=True
                        )
                    ANCHOR_RUNS[config.key] = []
            mono.run(prompt, 8)
            for round_index in range(args.rounds):
                runs["a"].append(mono.run(prompt, args.tokens))  # on this thread: one OpenMP team
                for key in keys:
                    runs[key].append(await api_run(apis[key], prompt, args.tokens))
                for config in anchors:
                    result, _ = await asyncio.to_thread(
                        rpc_anchor.run_bench,
                        args.rpc_tools,
                        config,
                        endpoints[: config.servers],
                        anchor_settings,
                    )
                    ANCHOR_RUNS[config.key].append(result.avg_ts)
                line = ", ".join(
                    [f"{k} {r[-1].decode_tps:.1f}" for k, r in runs.items()]
                    + [f"{k} {r[-1]:.1f}" for k, r in ANCHOR_RUNS.items()]
                )
                print(f"  round {round_index + 1}: tok/s {line}", file=sys.stderr, flush=True)
            if args.breakdown and "d" in meshes:
                hops = await hop_breakdown(meshes["d"], THREE, prompt, args.tokens)
            if args.answer_paths:
                for key in ("d", *DELAYS_MS):
                    if key in meshes:
                        print(f"  the answer's way back on {CONFIGS[key][0]}", file=sys.stderr, flush=True)
                        paths[key] = await answer_paths(meshes[key], THREE, prompt, args.tokens, args.rounds)
        finally:
            for mesh in meshes.values():
                await asyncio.to_thread(mesh.stop_all)
            mono.close()
    return runs, hops


# ---------------------------------------------------------------------------- per-hop breakdown


@dataclass(frozen=True)
class HopTiming:
    name: str
    layers: tuple[int, int]
    exec_ms: float
    round_trip_ms: float


@contextlib.asynccontextmanager
async def client_node(
    mesh: LocalMesh, layout: Layout
) -> AsyncIterator[tuple[Node, list[str], dict[str, bytes], shard.Fingerprint]]:
    """A node of this process joined to ``mesh`` (serving nothing), the mesh's node names, their
    ids, and the fingerprint the first one announces."""
    from meshnode.identity import NodeIdentity
    from meshnode.membership.credentials import decode_invite_token
    from meshnode.membership.store import DataDir
    from meshnode.node import Node, NodeConfig

    node = Node(
        NodeIdentity.generate(),
        DataDir(mesh.work_dir / f"bench-client-{time.monotonic_ns()}"),
        NodeConfig(listen="127.0.0.1:0", heartbeat_interval=1.0),
        invite=decode_invite_token(mesh.invite("n0")),
    )
    await node.start()
    try:
        await node.join()
        names = [f"n{i}" for i in range(len(layout))]
        ids = {}
        for name in names:
            status = mesh.child(name).status()
            assert status is not None
            ids[name] = bytes.fromhex(status["node"]["id"])
        fingerprint = None
        while fingerprint is None:
            for entry in node.peers():
                if entry.peer_id == ids["n0"] and entry.announcement.HasField("serving"):
                    fingerprint = entry.announcement.serving.fingerprint
            await asyncio.sleep(0.1)
        yield node, names, ids, fingerprint
    finally:
        await node.shutdown()


def served_ranges(layout: Layout) -> list[tuple[int, int]]:
    """Each node's layer range: a layout timed hop by hop has no node serving the whole model."""
    ranges = []
    for layers, _ in layout:
        assert layers is not None, "a node without a layer range"
        ranges.append(layers)
    return ranges


async def hop_breakdown(
    mesh: LocalMesh, layout: Layout, prompt: list[int], steps: int
) -> tuple[list[HopTiming], float]:
    """Drive each hop of ``mesh`` separately from a client node of the mesh (see the module doc)."""
    from engines.interface import GREEDY
    from meshnode.dataplane.edges.shard_session import ShardSession
    from meshnode.dataplane.route import make_hop

    ranges = served_ranges(layout)
    async with client_node(mesh, layout) as (node, names, ids, fingerprint):
        sessions = []
        for name, layers in zip(names, ranges, strict=True):
            link = await node.get_link(ids[name])
            session_range = shard.ShardRange(
                start_layer=layers[0], end_layer=layers[1], effective_start_layer=layers[0]
            )
            sessions.append(
                await ShardSession.open(
                    link, fingerprint=fingerprint, shard_range=session_range, sampling=GREEDY
                )
            )
        value: object = prompt
        for session in sessions:
            output = await session.prefill(value)
            value = output.hidden if output.token is None else output.token
        exec_ns: list[list[int]] = [[] for _ in sessions]
        trips: list[list[float]] = [[] for _ in sessions]
        for step in range(steps):
            position = len(prompt) + step
            for index, session in enumerate(sessions):
                started = time.perf_counter()
                output = await session.decode(value, position=position)
                trips[index].append(time.perf_counter() - started)
                exec_ns[index].append(output.done.execution_nanos)
                value = output.hidden if output.token is None else output.token
        for session in sessions:
            await session.aclose()
        # The same steps as one chained session: activations forwarded hop to hop.
        first = ranges[0]
        chained = await ShardSession.open(
            await node.get_link(ids[names[0]]),
            fingerprint=fingerprint,
            shard_range=shard.ShardRange(start_layer=first[0], end_layer=first[1], effective_start_layer=0),
            downstream=[
                make_hop(ids[name], layers[0], layers[1], layers[0])
                for name, layers in zip(names[1:], ranges[1:], strict=True)
            ],
            sampling=GREEDY,
        )
        token = (await chained.prefill(prompt)).token
        chain_trips = []
        for step in range(steps):
            started = time.perf_counter()
            token = (await chained.decode(token, position=len(prompt) + step)).token
            chain_trips.append(time.perf_counter() - started)
        await chained.aclose()
        hops = [
            HopTiming(name, layers, statistics.median(e) / 1e6, statistics.median(t) * 1000)
            for name, layers, e, t in zip(names, ranges, exec_ns, trips, strict=True)
        ]
        return hops, statistics.median(chain_trips) * 1000


# ---------------------------------------------------------------------------- the answer's way back


@dataclass(frozen=True)
class AnswerPaths:
    """Median decode round trip of one chained session, the token relayed back through every stage
    against the tail answering directly, measured alternately on the same mesh."""

    relayed_ms: float
    direct_ms: float


async def answer_paths(
    mesh: LocalMesh, layout: Layout, prompt: list[int], steps: int, rounds: int
) -> AnswerPaths:
    """From a client node of ``mesh``: one chained session through every hop, decoding ``steps``
    tokens, with the tail's token relayed back (the way before issue 20) and with the tail answering
    directly on an answer stream, alternating ``rounds`` times."""
    from engines.interface import GREEDY
    from meshnode.dataplane.edges.shard_session import DirectAnswers, ShardSession
    from meshnode.dataplane.route import make_hop

    ranges = served_ranges(layout)
    async with client_node(mesh, layout) as (node, names, ids, fingerprint):
        first, last = ranges[0], ranges[-1]
        trips: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for direct in (False, True):
                answers = None
                if direct:
                    answers = DirectAnswers(
                        links=functools.partial(node.get_link, ids[names[-1]]),
                        tail_range=shard.ShardRange(
                            start_layer=last[0], end_layer=last[1], effective_start_layer=last[0]
                        ),
                    )
                session = await ShardSession.open(
                    await node.get_link(ids[names[0]]),
                    fingerprint=fingerprint,
                    shard_range=shard.ShardRange(
                        start_layer=first[0], end_layer=first[1], effective_start_layer=0
                    ),
                    downstream=[
                        make_hop(ids[name], layers[0], layers[1], layers[0])
                        for name, layers in zip(names[1:], ranges[1:], strict=True)
                    ],
                    sampling=GREEDY,
                    answers=answers,
                )
                if direct and not await session.answers_ready():
                    raise RuntimeError("the tail refused the answer stream")
                token = (await session.prefill(prompt)).token
                for step in range(steps):
                    started = time.perf_counter()
                    output = await session.decode(token, position=len(prompt) + step)
                    trips[direct].append(time.perf_counter() - started)
                    assert output.done.answered_directly == direct
                    token = output.token
                await session.aclose()
        return AnswerPaths(statistics.median(trips[False]) * 1000, statistics.median(trips[True]) * 1000)


# ---------------------------------------------------------------------------- main


def prepare_run(args: argparse.Namespace) -> Path:
    """The model, with ``args.repack`` set: one repack setting serves (a) and every node, what a
    node's own probe chooses here.

    ``--node-env`` goes to the nodes (``nodes_env``) and into this process's environment, but
    OpenMP settings do not reach (a): libgomp read them when llama.cpp loaded, on import. (a)
    runs with the OpenMP waiting this process started with (libgomp's own spin unless exported
    before the bench), as llama.cpp run alone on this machine does."""
    args.node_env = list(args.node_env or [])
    os.environ.update(given_node_env(args))
    # --model where a bench has it (bench/concurrency.py): a machine without the Gemma package.
    given_model = getattr(args, "model", None)
    model = given_model if given_model is not None else default_model_path(progress=True)
    args.repack = choose_weight_repack(
        WeightRepack.AUTO, ProbeTarget(model, threads=args.threads)
    ).weight_repack
    return model


def given_node_env(args: argparse.Namespace) -> dict[str, str]:
    """``--node-env KEY=VALUE`` items as a mapping."""
    return dict(item.split("=", 1) for item in args.node_env)


def nodes_env(args: argparse.Namespace, processes: int) -> dict[str, str]:
    """The environment of a mesh of ``processes`` nodes: the OpenMP waiting that suits them on
    this machine (engines.openmp_wait: a short spin where they and this bench's client share the
    cores, libgomp's own where each node has cores of its own, as on machines of their own), the
    weight repack choice, then ``--node-env`` (which may replace either)."""
    env = openmp_wait_env(processes, args.threads, available_cpus(), others=1)
    env["MESHNODE_WEIGHT_REPACK"] = "on" if args.repack else "off"
    env.update(given_node_env(args))
    return env


def describe_openmp(env: Mapping[str, str]) -> str:
    """How a process under ``env`` waits in OpenMP, for the benches' headers."""
    spin = env.get("GOMP_SPINCOUNT")
    return "libgomp's own spin" if spin is None else f"GOMP_SPINCOUNT={spin}"


def random_prompt(rng: np.random.Generator, tokens: int) -> list[int]:
    """BOS and ordinary text-like token ids."""
    return [2] + [int(t) for t in rng.integers(1000, 50_000, size=tokens - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32, help="generated per request (32)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="threads of (a) and of each node (2)")
    parser.add_argument(
        "--configs",
        default="b,c,d,e",
        help="comma-separated: b, c, d, dt, e, c1, d1, and the llama.cpp anchor's rpc1, rpc2, rpc3 (b,c,d,e)",
    )
    parser.add_argument(
        "--rpc",
        action="store_true",
        help="also run the llama.cpp RPC anchor: rpc1 (local), rpc2 (2-way), rpc3 (3-way); builds "
        "llama-bench and ggml-rpc-server on first use (bench/build_llama_rpc.sh)",
    )
    parser.add_argument(
        "--rpc-reps", type=int, default=3, help="llama-bench -r: repetitions per anchor run per round (3)"
    )
    parser.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per-hop timing on the three-node mesh (default on)",
    )
    parser.add_argument(
        "--node-env",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="environment of the node processes, added to (or replacing) the OpenMP waiting that "
        "suits them here: GOMP_SPINCOUNT=1000 where the nodes share the cores, libgomp's own spin "
        "where each has cores of its own (engines.openmp_wait); OpenMP settings reach (a) only "
        "when exported before the bench",
    )
    parser.add_argument(
        "--answer-paths",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on each three-node mesh, a chained session's decode round trip with the token relayed "
        "back through every stage against the tail answering directly (default on)",
    )
    parser.add_argument(
        "--speculation",
        choices=("auto", "off"),
        default="auto",
        help="the nodes' --speculation (auto, their default; off: issue 20's target for (d) is "
        "without it, and the random bench prompt still gives the drafter some matches)",
    )
    parser.add_argument(
        "--delay-ms",
        type=float,
        action="append",
        default=[],
        metavar="MS",
        help="also run (d) with MS ms of added one-way delay between nodes (repeatable: 10 and 20)",
    )
    args = parser.parse_args()
    names = [name for name in args.configs.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS and name not in rpc_anchor.ANCHORS]
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(unknown)}")
    args.mesh_configs = [name for name in names if name in CONFIGS]
    wanted = {name for name in names if name in rpc_anchor.ANCHORS} | (
        set(rpc_anchor.ANCHORS) if args.rpc else set()
    )
    if wanted:
        wanted.add(rpc_anchor.BASELINE)  # every split's ratio is against the anchor's own local run
    args.anchor_configs = [key for key in rpc_anchor.ANCHORS if key in wanted]
    # Built (or found in the cache) before anything starts, so a build never overlaps the rounds.
    args.rpc_tools = rpc_anchor.build_tools() if args.anchor_configs else None
    for delay_ms in args.delay_ms:
        key = delayed_key(delay_ms)
        CONFIGS[key] = (f"(d+{delay_ms:g} ms) 3 nodes, +{delay_ms:g} ms one way", THREE, None)
        DELAYS_MS[key] = delay_ms
    model = prepare_run(args)
    # A fixed seed so every configuration prefills the same prompt.
    prompt = random_prompt(np.random.default_rng(7), args.prompt_tokens)
    runs, (hops, chain_ms) = asyncio.run(bench(args, model, prompt))

    base = median_run(runs["a"])
    print(f"Gemma 3 270M Q4_K_M, greedy, prompt {args.prompt_tokens} tokens, {args.tokens} generated per request, "
          f"medians of {args.rounds} alternating rounds; (a) = monolithic llama-cpp-python, {args.threads} threads; "
          f"weight repack {'on' if args.repack else 'off'} everywhere")  # fmt: skip
    print(f"{'configuration':<34} {'decode tok/s':>12} {'ratio':>7} {'ms/token':>9} {'+ms/token':>10} "
          f"{'TTFT s':>8} {'ratio':>7}")  # fmt: skip
    for key, label in [("a", "(a) monolithic"), *((k, CONFIGS[k][0]) for k in runs if k != "a")]:
        run = median_run(runs[key])
        ratio = run.decode_tps / base.decode_tps
        extra = 1000 / run.decode_tps - 1000 / base.decode_tps
        target = ""
        if key in TARGETS:
            target = f"  target >= {TARGETS[key]:.2f}x: {'met' if ratio >= TARGETS[key] else 'MISSED'}"
        print(f"{label:<34} {run.decode_tps:>12.1f} {ratio:>6.3f}x {1000 / run.decode_tps:>9.2f} {extra:>+10.2f} "
              f"{run.ttft_s:>8.3f} {run.ttft_s / base.ttft_s:>6.3f}x{target}")  # fmt: skip

    if ANCHOR_RUNS:
        print_anchor(args, runs)
    if ANSWER_PATHS:
        print()
        print("the answer's way back: one chained session from a client node, decode round trip (medians, "
              "alternating rounds)")  # fmt: skip
        print(f"{'configuration':<34} {'relayed ms':>11} {'direct ms':>10} {'saved ms':>9}")
        for key, path in ANSWER_PATHS.items():
            print(f"{CONFIGS[key][0]:<34} {path.relayed_ms:>11.2f} {path.direct_ms:>10.2f} "
                  f"{path.relayed_ms - path.direct_ms:>9.2f}")  # fmt: skip
    if hops:
        print()
        print("where a decode step goes, three nodes, each hop driven alone from a client node (medians):")
        print(f"{'hop':<14} {'engine ms':>10} {'round trip ms':>14} {'beyond compute ms':>18}")
        for hop in hops:
            label = f"{hop.name} [{hop.layers[0]},{hop.layers[1]})"
            print(
                f"{label:<14} {hop.exec_ms:>10.2f} {hop.round_trip_ms:>14.2f} {hop.round_trip_ms - hop.exec_ms:>18.2f}"
            )
        total_exec = sum(h.exec_ms for h in hops)
        total_trip = sum(h.round_trip_ms for h in hops)
        print(f"{'sum':<14} {total_exec:>10.2f} {total_trip:>14.2f} {total_trip - total_exec:>18.2f}")
        print(
            f"{'chained':<14} {'':>10} {chain_ms:>14.2f} {chain_ms - total_exec:>18.2f}  (one session, hop to hop)"
        )


def print_anchor(args: argparse.Namespace, runs: dict[str, list[Run]]) -> None:
    """The llama.cpp RPC anchor's table, meshnode's (c) and (d) beside it, and issue 20's target."""
    base_tps = statistics.median(ANCHOR_RUNS[rpc_anchor.BASELINE])
    print()
    print(f"llama.cpp RPC anchor: llama-bench -p 0 -n {args.tokens} -d {args.prompt_tokens} -r {args.rpc_reps}, "
          f"{args.threads} threads per process, loopback, medians over {args.rounds} rounds of each run's mean; "
          f"ratio and +ms/token against {rpc_anchor.BASELINE} (llama.cpp local), meshnode's against (a)")  # fmt: skip
    print(
        f"{'configuration':<34} {'decode tok/s':>12} {'ratio':>7} {'ms/token':>9} {'+ms/token':>10}  placement"
    )
    added: dict[str, float] = {}
    for key, samples in ANCHOR_RUNS.items():
        tps = statistics.median(samples)
        added[key] = rpc_anchor.added_ms_per_token(tps, base_tps)
        print(f"{rpc_anchor.ANCHORS[key].label:<34} {tps:>12.1f} {tps / base_tps:>6.3f}x {1000 / tps:>9.2f} "
              f"{added[key]:>+10.2f}  {ANCHOR_PLACEMENT.get(key, '')}")  # fmt: skip
    mono_tps = median_run(runs["a"]).decode_tps
    for key in ("c", "d"):
        if key in runs:
            tps = median_run(runs[key]).decode_tps
            added[key] = rpc_anchor.added_ms_per_token(tps, mono_tps)
            print(f"{'meshnode ' + CONFIGS[key][0]:<34} {tps:>12.1f} {tps / mono_tps:>6.3f}x {1000 / tps:>9.2f} "
                  f"{added[key]:>+10.2f}  against (a) {mono_tps:.1f} tok/s")  # fmt: skip
    if "d" in added and "rpc3" in added:
        bound = 2 * added["rpc3"]
        verdict = "met" if added["d"] <= bound else "MISSED"
        # A split cannot be faster than its own monolithic run; when one reads so, its baseline
        # was starved (a busy machine hits (a) in the bench process hardest) and no verdict holds.
        if added["d"] < 0 or added["rpc3"] <= 0:
            verdict = "not decidable (a split reads faster than its baseline: a busy machine?)"
        print(
            f"issue 20 target: (d) added ms/token <= 2x RPC 3-way's: {added['d']:+.2f} <= {bound:+.2f}: {verdict}"
        )


if __name__ == "__main__":
    main()
