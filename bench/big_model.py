"""A model that needs the mesh (issue 53): Llama 3 8B's shape, created, joined, fetched and served.

    python bench/big_model.py [--prompt-tokens 1024,4096] [--tokens 16] [--threads 2]
                              [--first-layers N] [--tls-mib 512] [--no-monolithic] [--no-mesh]
                              [--n-gpu-layers N] [--size llama3-8b]
                              [--no-rpc | --build-rpc] [--rpc-prompt 64] [--rpc-tokens 16]
                              [--rpc-depth D] [--rpc-reps 2]

The model is bench/random_model.py's ``llama3-8b`` (32 layers, n_embd 4096, Q4_0, 4.5 GB;
generated and cached on first use, ~30 s). Everything runs on this machine, in one run:

1. TLS over TCP between two processes on loopback (Python's ``ssl`` and asyncio, the
   kernel's TCP): a child sends ``--tls-mib`` MiB, this process reads it. The bulk lane's
   ceiling here, what the mesh's fetch throughput is held against.
2. A mesh of real ``meshnode`` processes: A is created with the model serving
   [0, ``--first-layers``) (default: 11 of every 32 layers, 11 at the 8B shape, 1 of
   q4-tiny's 4); B and C start at the same moment with only an invite, no model
   and empty caches, each with a ``--memory-budget`` of ``--first-layers`` ordinary layers
   and one vocabulary-sized table, so neither holds the rest alone and the model ends split
   three ways. Their placement status is polled every half second: join to serving per
   joiner, split into choosing (manifest, claim), fetching (streamed, hashed, journaled)
   and loading (probe, slice, llama.cpp load), with the transfer's rate as the node's own
   progress reports it. Bytes fetched are held against the bytes of the range's tensors;
   fetch throughput against (1).
3. Each node's resident memory against its budget (weights + KV + compute buffers, as
   llama.cpp reported them: ``meshnode status``'s ``memory`` section).
4. One greedy generation per ``--prompt-tokens`` length through A's API (streamed; time to
   first token, decode tokens/s over ``--tokens``), then the mesh is stopped and (5) runs.
5. Monolithic llama-cpp-python (bench/e2e.py's ``Monolithic``: one context, ``--threads``
   threads) on the same prompts.
6. llama.cpp's own RPC split on the same file, the issue's anchor for the decode ratio
   (bench/rpc_anchor.py, the tools built by bench/build_llama_rpc.sh): ``llama-bench`` alone
   (local, 1 process) and with two ``ggml-rpc-server`` processes on loopback (3-way), cut as
   the mesh's ranges chain (A's, then each joiner's from where the hop before ended; without
   the mesh, or where the joiners' ranges do not chain, [0, ``--first-layers``) and the rest
   halved): blocks of A's hop and the embeddings in
   llama-bench, B's on the first server, C's and the output layer on the second, checked
   against llama.cpp's own load log. Each process gets ``--threads`` threads; the ratio is
   3-way ÷ local, llama.cpp's own cost of the split, beside the mesh's ÷ monolithic (the
   tools are a separate build, so no figure crosses between the two). Each llama-bench is
   one run: ``-p --rpc-prompt -n --rpc-tokens -d --rpc-depth -r --rpc-reps``, a prefill and
   a decode test, both after ``--rpc-depth`` tokens of context (filled untimed, once per
   process: llama-bench keeps the state and restores it for each test and repetition).
   The depth defaults to the shortest ``--prompt-tokens`` (1024), so the decode is measured
   where the mesh's first decode is; on 2 cores that fill is ~100 s per process at the 8B
   shape (about 4 of this part's ~5 minutes). 4096 would be ~10 minutes per process for a
   figure the ratio barely needs (at this size a token's weights, 4.5 GB, dwarf its KV reads,
   ~0.5 GB at 4096), hence not the default; ``--rpc-depth 0`` drops the fill. Decode is
   short (16 tokens, 2 repetitions after llama-bench's own warm-up token): ~10 s a process
   at 3-4 tokens/s. ``--no-rpc`` skips the part; when the tools are not built it is skipped
   with a message (``--build-rpc`` builds them first: ~10 minutes on 2 cores, cached under
   ~/.cache/meshnode/llama-rpc).

The wire's share of a prompt: each hop carries the prompt's activations, n_tokens x n_embd x
4 bytes (float32); their time on the mesh's QUIC path is that size over meshnode's own QUIC
throughput measured at the start of the run (bench/transport.py's bulk: the endpoint, framing
and credit the data plane uses, two processes on loopback), two hops for three nodes, against
the mesh's time to first token. The joiners' fetch goes over the bulk lane (TLS over TCP)
between these direct peers, so its rate is not the data plane's.

2 cores make an 8B prefill slow (~10 tokens/s): the default run takes about half an hour.
Each figure is printed as it is measured. ``--n-gpu-layers 99`` offloads every node's layers and
the monolithic model's (bench/device_check.sh --big-model); ``--size`` takes another of
bench/random_model.py's shapes (``q4-tiny``: the script's own quick check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rpc_anchor  # noqa: E402
from e2e import Monolithic, Run  # noqa: E402
from random_model import SIZES, ensure_random_model  # noqa: E402

from engines.engine_guard import choose_weight_repack  # noqa: E402
from engines.engine_probe import ProbeTarget  # noqa: E402
from engines.gguf_file import metadata_int, read_gguf  # noqa: E402
from engines.openmp_wait import available_cpus, openmp_wait_env  # noqa: E402
from engines.slicing import tensors_for_range  # noqa: E402
from engines.weight_repack import WeightRepack  # noqa: E402
from meshnode.app.local_mesh import Child, LocalMesh  # noqa: E402
from meshnode.head.api_client import StreamSummary, stream_completion  # noqa: E402

MIB = 1 << 20
JOIN_TIMEOUT_S = 3600.0
TLS_CHUNK = 1 << 20
# The longest silence a request may meet: a 4096-token prompt's prefill on 2 cores is minutes.
API_SILENCE_S = 3600.0
# One llama-bench run of the anchor: the depth fill alone is ~100 s at the 8B shape on 2 cores.
RPC_BENCH_TIMEOUT_S = 3600.0


# ---------------------------------------------------------------------------- (1) TLS over TCP


def _tls_sender(port_file: Path, nbytes: int) -> None:
    """The child: serve one TLS connection on loopback and send ``nbytes`` to it."""
    from cryptography.hazmat.primitives import serialization

    from meshnode.identity import NodeIdentity
    from meshnode.transport.quic_connection import self_signed_certificate

    identity = NodeIdentity.generate()
    work = Path(tempfile.mkdtemp())
    cert, key = work / "cert.pem", work / "key.pem"
    cert.write_bytes(self_signed_certificate(identity).public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        identity.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    chunk = os.urandom(TLS_CHUNK)

    async def serve() -> None:
        done = asyncio.Event()

        async def send(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sent = 0
            while sent < nbytes:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()
            done.set()

        server = await asyncio.start_server(send, "127.0.0.1", 0, ssl=context)
        port_file.write_text(str(server.sockets[0].getsockname()[1]))
        await done.wait()
        server.close()

    asyncio.run(serve())


async def tls_bulk_bytes_per_s(mib: int) -> float:
    """One-way TLS 1.3 over TCP from a child process to this one on loopback."""
    port_file = Path(tempfile.mkdtemp()) / "port"
    child = subprocess.Popen(
        [sys.executable, __file__, "--tls-sender", str(port_file), str(mib * MIB)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        while not port_file.exists() or not port_file.read_text():
            await asyncio.sleep(0.05)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        client.verify_mode = ssl.CERT_NONE
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port_file.read_text()), ssl=client)
        started = time.perf_counter()
        received = 0
        while chunk := await reader.read(TLS_CHUNK):
            received += len(chunk)
        elapsed = time.perf_counter() - started
        writer.close()
        assert received == mib * MIB, received
        return received / elapsed
    finally:
        child.wait(30)


def quic_bulk_bytes_per_s(mib: int) -> float:
    """One-way bulk over meshnode's own QUIC stack (bench/transport.py: QuicEndpoint, framing,
    dispatch, its credit), child to this process on loopback: the path a hop's activations take."""
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "transport.py"), "--rounds", "20", "--trials", "2",
         "--bulk-mib", str(mib), "--bulk-rounds", "3", "--json"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if completed.returncode != 0:
        raise RuntimeError(f"bench/transport.py failed: {completed.stderr[-2000:]}")
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    return float(results["meshnode"]["bulk_mbit_s"]) * 1e6 / 8


# ---------------------------------------------------------------------------- (2) joining


@dataclass
class JoinTimeline:
    """When a joiner's placement state first showed each value, and what its transfer said."""

    started: float
    states: dict[str, float] = field(default_factory=dict)
    layers: tuple[int, int] | None = None
    fetched_bytes: int = 0
    # The transfer's own rate report, sampled while fetching (bytes/s).
    rates: list[float] = field(default_factory=list)
    etas: list[tuple[float, float]] = field(default_factory=list)

    def seen(self, state: str, now: float) -> None:
        key = state.split(":")[0]
        if key not in self.states:
            self.states[key] = now
            print(f"    +{now - self.started:7.1f} s  {key}", flush=True)

    def span(self, start: str, end: str) -> float | None:
        if start in self.states and end in self.states:
            return self.states[end] - self.states[start]
        return None


def placement(child: Child) -> dict[str, Any]:
    status = child.status()
    return {} if status is None else dict(status.get("sections", {}).get("placement", {}))


async def watch_joiners(mesh: LocalMesh, joiners: list[Child], started: float) -> dict[str, JoinTimeline]:
    timelines = {child.name: JoinTimeline(started) for child in joiners}
    last_print = dict.fromkeys(timelines, 0.0)
    while True:
        now = time.monotonic()
        for child in joiners:
            if not child.alive():
                raise RuntimeError(child.exit_message("joining"))
            report = placement(child)
            timeline = timelines[child.name]
            if state := report.get("state"):
                timeline.seen(str(state), now)
            if layers := report.get("layers"):
                timeline.layers = (int(layers[0]), int(layers[1]))
            timeline.fetched_bytes = int(report.get("fetched_bytes", 0))
            transfer = report.get("transfer")
            if transfer and not transfer.get("finished") and transfer.get("rate_bytes_per_s"):
                timeline.rates.append(float(transfer["rate_bytes_per_s"]))
                if transfer.get("eta_s") is not None:
                    timeline.etas.append((now, float(transfer["eta_s"])))
                if now - last_print[child.name] > 20:
                    eta = "estimating" if transfer.get("eta_s") is None else f"{transfer['eta_s']} s"
                    print(
                        f"    {child.name} {transfer['label']}: {transfer['done_bytes'] / MIB:.0f}/"
                        f"{transfer['total_bytes'] / MIB:.0f} MiB, {transfer['rate_bytes_per_s'] / MIB:.1f} "
                        f"MiB/s, ETA {eta}",
                        flush=True,
                    )
                    last_print[child.name] = now
        if all("serving" in t.states for t in timelines.values()):
            return timelines
        if now - started > JOIN_TIMEOUT_S:
            raise RuntimeError(f"not serving after {JOIN_TIMEOUT_S:.0f} s: {timelines}")
        await asyncio.sleep(0.5)


def range_bytes(model: Path, layers: tuple[int, int]) -> int:
    header = read_gguf(model)
    needed = tensors_for_range(header, *layers)
    return sum(t.nbytes for t in header.tensors if t.name in needed)


def joiner_budget(model: Path, layers: int) -> int:
    """``layers`` ordinary layers and one vocabulary-sized table (the largest), a MiB spare."""
    sizes = {t.name: t.nbytes for t in read_gguf(model).tensors}
    layer = sum(size for name, size in sizes.items() if name.startswith("blk.1."))
    return layers * layer + max(sizes["output.weight"], sizes["token_embd.weight"]) + MIB


# ---------------------------------------------------------------------------- the run


async def api_run(api: str, prompt: list[int], tokens: int) -> Run:
    """One greedy streamed /v1/completions of ``prompt`` (token ids)."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    summary = None
    async for event in stream_completion(api, "/v1/completions", body, timeout_s=API_SILENCE_S):
        if isinstance(event, StreamSummary):
            summary = event
    assert summary is not None
    return Run(summary.time_to_first_token_s, summary.decode_tokens_per_s, summary.completion_tokens)


def print_memory(name: str, status: dict[str, Any] | None) -> float | None:
    memory = None if status is None else status.get("sections", {}).get("memory")
    if not memory:
        print(f"  {name}: no memory report", flush=True)
        return None
    budget = memory["budget"]
    ratio = memory["rss_bytes"] / memory["budget_bytes"]
    print(
        f"  {name}: resident {memory['rss_bytes'] / MIB:.0f} MiB (shard's own {memory['shard_bytes'] / MIB:.0f})"
        f" / budget {memory['budget_bytes'] / MIB:.0f} MiB (weights {budget['weights_bytes'] / MIB:.0f}, KV "
        f"{budget['kv_bytes'] / MIB:.0f}, compute {budget['compute_bytes'] / MIB:.0f}, output "
        f"{budget['output_bytes'] / MIB:.0f}) = {ratio:.2f} (shard's own "
        f"{memory['shard_bytes'] / memory['budget_bytes']:.2f})",
        flush=True,
    )
    return ratio


def one_source_rate(fetches: list[tuple[float, float, int]]) -> float:
    """What the one source (A) delivered while it served: every joiner's bytes over the time at
    least one of them was fetching. Joiners fetching at once share A, so neither one's own rate
    is A's; joiners fetching one after the other are each A's rate, and this is their mean by
    bytes."""
    busy = 0.0
    covered_to = float("-inf")
    for start, end, _ in sorted(fetches):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return sum(nbytes for _, _, nbytes in fetches) / busy if busy > 0 else 0.0


async def mesh_part(
    args: argparse.Namespace, model: Path, prompts: dict[int, list[int]], env: dict[str, str], work: Path
) -> tuple[dict[int, Run], float, list[tuple[int, int]]]:
    """(2)-(4); returns the runs per prompt length, the fetch throughput from one source and the
    joiners' layer ranges."""
    mesh = LocalMesh(work, model, threads=args.threads, ctx=args.ctx, env=env, timing=())
    offload = ["--n-gpu-layers", str(args.n_gpu_layers)] if args.n_gpu_layers else []
    try:
        mesh.create_mesh("A")
        started = time.monotonic()
        await mesh.start_first("A", (0, args.first_layers), extra=offload)
        print(f"  A (created with the model, [0, {args.first_layers})): serving after "
              f"{time.monotonic() - started:.1f} s (manifest, probe, slice, load)", flush=True)  # fmt: skip
        token = mesh.invite("A")
        budget = joiner_budget(model, args.first_layers)
        print(f"  B and C join with only the invite, --memory-budget {budget / MIB:.0f} MiB", flush=True)
        joiners = []
        started = time.monotonic()
        for name in ("B", "C"):
            data_dir = work / name
            joiners.append(mesh.spawn(
                name, "join", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0",
                "--threads", str(args.threads), "--ctx", str(args.ctx), "--api-listen", "off",
                "--memory-budget", str(budget), *offload,
                env={"MESHNODE_INVITE": token, "MESHNODE_CACHE_DIR": str(work / f"{name}-cache")},
                data_dir=data_dir,
            ))  # fmt: skip
        timelines = await watch_joiners(mesh, joiners, started)
        # (start, end, bytes) of each joiner's fetch from A, for what A delivered while it served.
        fetches: list[tuple[float, float, int]] = []
        ranges = []
        for name, timeline in timelines.items():
            assert timeline.layers is not None
            ranges.append(timeline.layers)
            share = range_bytes(model, timeline.layers)
            fetch = timeline.span("fetching", "loading")
            load = timeline.span("loading", "serving")
            total = timeline.states["serving"] - started
            rate = timeline.fetched_bytes / fetch if fetch else 0.0
            if fetch:
                fetches.append(
                    (timeline.states["fetching"], timeline.states["loading"], timeline.fetched_bytes)
                )
            print(
                f"  {name} layers [{timeline.layers[0]}, {timeline.layers[1]}): join to serving {total:.1f} s "
                f"(choosing {timeline.states.get('fetching', started) - started:.1f} s, fetch + "
                f"verify {fetch or 0:.1f} s, load {load or 0:.1f} s); fetched {timeline.fetched_bytes / MIB:.0f}"
                f" MiB / range {share / MIB:.0f} MiB = {timeline.fetched_bytes / share:.4f}; "
                f"{rate / MIB:.1f} MiB/s",
                flush=True,
            )
            if timeline.rates:
                print(f"    its progress bar's rate: first {timeline.rates[0] / MIB:.1f}, median "
                      f"{float(np.median(timeline.rates)) / MIB:.1f}, last {timeline.rates[-1] / MIB:.1f} MiB/s",
                      flush=True)  # fmt: skip
            if timeline.etas:
                first_at, first_eta = timeline.etas[0]
                print(f"    its first ETA {first_eta:.0f} s, {timeline.states['loading'] - first_at:.0f} s "
                      "before the fetch ended", flush=True)  # fmt: skip
        api, _ = await mesh.wait_route("A")
        print("memory per node (resident / (weights + KV + compute + output buffers)):", flush=True)
        for child in mesh.children:
            if child.data_dir is not None:
                print_memory(child.name, child.status())
        runs: dict[int, Run] = {}
        for length, prompt in prompts.items():
            run = await api_run(api, prompt, args.tokens)
            runs[length] = run
            print(f"  mesh, {length}-token prompt: time to first token {run.ttft_s:.1f} s, decode "
                  f"{run.decode_tps:.2f} tokens/s", flush=True)  # fmt: skip
        print("memory per node after the prompts:", flush=True)
        for child in mesh.children:
            if child.data_dir is not None:
                print_memory(child.name, child.status())
        return runs, one_source_rate(fetches), ranges
    finally:
        mesh.stop_all()


# ---------------------------------------------------------------------------- (6) llama.cpp RPC


def three_hop_cuts(
    first: tuple[int, int], joiners: list[tuple[int, int]], n_layer: int
) -> tuple[int, int] | None:
    """The mesh's three ranges as three hops: A's, then each joiner (in the order of where their
    ranges start) from where the hop before ended to its own end; ``None`` unless every hop holds
    a layer and the last ends the model. On the 8B run A [0, 11), B [11, 24) and C [21, 32) gave
    [0, 11), [11, 24), [24, 32): C served the part of its range B did not."""
    if first[0] != 0:
        return None
    ends = [first[1]]
    for start, end in sorted(joiners):
        if not start <= ends[-1] < end:
            return None
        ends.append(end)
    return (ends[0], ends[1]) if len(ends) == 3 and ends[2] == n_layer else None


@dataclass(frozen=True)
class AnchorRun:
    label: str
    decode: rpc_anchor.BenchResult
    prefill: rpc_anchor.BenchResult | None


def rpc_part(
    args: argparse.Namespace,
    model: Path,
    tools: Path,
    repack: bool,
    env: dict[str, str],
    n_layer: int,
    cuts: tuple[int, int],
) -> tuple[AnchorRun, AnchorRun]:
    """(6): llama-bench local, then 3-way over two rpc-servers, blocks cut at ``cuts``."""
    settings = rpc_anchor.BenchSettings(
        model=model, threads=args.threads, tokens=args.rpc_tokens, depth=args.rpc_depth, reps=args.rpc_reps,
        repack=repack, env=env, prompt_tokens=args.rpc_prompt,
    )  # fmt: skip
    local = rpc_anchor.ANCHORS[rpc_anchor.BASELINE]
    three_way = rpc_anchor.three_way_config(n_layer, *cuts)
    print(f"llama.cpp RPC anchor: llama-bench -p {args.rpc_prompt} -n {args.rpc_tokens} -d {args.rpc_depth} "
          f"-r {args.rpc_reps}, {args.threads} threads per process, loopback; 3-way: blocks [0, {cuts[0]}) local, "
          f"[{cuts[0]}, {cuts[1]}) and [{cuts[1]}, {n_layer}) + output on two rpc-servers "
          f"(-ngl {three_way.n_gpu_layers} -ts {three_way.tensor_split})", flush=True)  # fmt: skip
    runs = []
    with (
        tempfile.TemporaryDirectory(prefix="big-model-rpc-") as logs,
        rpc_anchor.RpcServers(tools, 2, args.threads, env, Path(logs)) as servers,
    ):
        for config in (local, three_way):
            endpoints = servers.endpoints[: config.servers]
            started = time.perf_counter()
            # Verbose for the load log the placement check reads; it adds no lines per token.
            tests, log = rpc_anchor.run_bench_tests(
                tools, config, endpoints, settings, verbose=True, timeout_s=RPC_BENCH_TIMEOUT_S
            )
            run = AnchorRun(config.label, rpc_anchor.decode_test(tests), rpc_anchor.prefill_test(tests))
            runs.append(run)
            prefill = "" if run.prefill is None else f"prefill {run.prefill.avg_ts:.2f} tokens/s, "
            print(f"  {config.label}: {prefill}decode {run.decode.avg_ts:.2f} tokens/s "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
            if config.servers:
                placed = rpc_anchor.check_placement(config, rpc_anchor.parse_placement(log), endpoints)
                print(f"    placement, from llama.cpp's load log: {placed}", flush=True)
    return runs[0], runs[1]


async def main_async(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    # Found (or built) before anything is measured, so a build never overlaps a measurement.
    tools = None
    if not args.no_rpc:
        tools = rpc_anchor.build_tools() if args.build_rpc else rpc_anchor.cached_tools()
        if tools is None:
            print("llama.cpp RPC anchor: skipped, llama-bench and ggml-rpc-server are not built "
                  "(--build-rpc builds them first, or bench/build_llama_rpc.sh; ~10 minutes on 2 cores)",
                  flush=True)  # fmt: skip
    model = ensure_random_model(args.size)
    print(f"model: {model} ({model.stat().st_size / 1e9:.2f} GB), ready after "
          f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    header = read_gguf(model)
    n_embd = metadata_int(header.get(f"{header.architecture}.embedding_length"))
    n_layer = metadata_int(header.get(f"{header.architecture}.block_count"))
    if args.first_layers is None:
        args.first_layers = min(max(round(n_layer * 11 / 32), 1), n_layer - 2)
    n_vocab = next(int(t.shape[1]) for t in header.tensors if t.name == "token_embd.weight")
    rng = np.random.default_rng(53)
    # BOS, then ordinary tokens (past the control and byte tokens, inside every shape's vocabulary).
    prompts = {
        length: [1, *(int(t) for t in rng.integers(300, min(50_000, n_vocab), size=length - 1))]
        for length in args.prompt_tokens
    }
    tls = await tls_bulk_bytes_per_s(args.tls_mib)
    print(f"TLS 1.3 over TCP, two processes on loopback: {tls / MIB:.0f} MiB/s", flush=True)
    activation_path = await asyncio.to_thread(quic_bulk_bytes_per_s, 64)
    print(f"meshnode's QUIC (the data plane's path), two processes on loopback: {activation_path / MIB:.1f} MiB/s",
          flush=True)  # fmt: skip
    repack = choose_weight_repack(
        WeightRepack.AUTO, ProbeTarget(model, threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    ).weight_repack
    env = openmp_wait_env(3, args.threads, available_cpus(), others=1)
    env["MESHNODE_WEIGHT_REPACK"] = "on" if repack else "off"
    mesh_runs: dict[int, Run] = {}
    fetch = 0.0
    rest = n_layer - args.first_layers
    cuts = (args.first_layers, args.first_layers + (rest + 1) // 2)
    if not args.no_mesh:
        with tempfile.TemporaryDirectory(prefix="big-model-") as work:
            mesh_runs, fetch, ranges = await mesh_part(args, model, prompts, env, Path(work))
        mesh_cuts = three_hop_cuts((0, args.first_layers), ranges, n_layer)
        if mesh_cuts is None:
            print(f"  the joiners' ranges {ranges} after A's [0, {args.first_layers}) make no three hops: the "
                  f"llama.cpp RPC 3-way is cut at {cuts[0]} and {cuts[1]}", flush=True)  # fmt: skip
        cuts = mesh_cuts or cuts
        print(f"fetch from one source (the bulk lane: TLS over TCP between direct peers) {fetch / MIB:.1f} MiB/s "
              f"/ TLS over TCP {tls / MIB:.0f} MiB/s = {fetch / tls:.3f}", flush=True)  # fmt: skip
    mono_runs: dict[int, Run] = {}
    if not args.no_monolithic:
        mono = Monolithic(model, args.threads, repack, n_ctx=args.ctx, n_gpu_layers=args.n_gpu_layers)
        try:
            for length, prompt in prompts.items():
                mono_runs[length] = mono.run(prompt, args.tokens)
                print(f"  monolithic, {length}-token prompt: time to first token "
                      f"{mono_runs[length].ttft_s:.1f} s, decode {mono_runs[length].decode_tps:.2f} tokens/s",
                      flush=True)  # fmt: skip
        finally:
            mono.close()
    anchor: tuple[AnchorRun, AnchorRun] | None = None
    if tools is not None:
        anchor = rpc_part(args, model, tools, repack, env, n_layer, cuts)
    print("\nsummary:")
    for length in mesh_runs:
        mesh_run = mesh_runs[length]
        hop_bytes = length * n_embd * 4
        wire_s = 2 * hop_bytes / activation_path
        line = (f"  {length} tokens: {hop_bytes / MIB:.0f} MiB of activations a hop, ~{wire_s:.1f} s on QUIC "
                f"for two hops = {wire_s / mesh_run.ttft_s:.1%} of the mesh's {mesh_run.ttft_s:.1f} s to first "
                f"token")  # fmt: skip
        if length in mono_runs:
            mono_run = mono_runs[length]
            line += (f"; TTFT mesh/monolithic {mesh_run.ttft_s / mono_run.ttft_s:.2f} (target <= 1.2), decode "
                     f"{mesh_run.decode_tps / mono_run.decode_tps:.2f} (target >= 0.9)")  # fmt: skip
        print(line, flush=True)
    if anchor is not None:
        local, three_way = anchor
        line = (f"  llama.cpp RPC 3-way / llama.cpp local (llama-bench, after {args.rpc_depth} tokens): decode "
                f"{three_way.decode.avg_ts:.2f} / {local.decode.avg_ts:.2f} = "
                f"{three_way.decode.avg_ts / local.decode.avg_ts:.2f}")  # fmt: skip
        if local.prefill is not None and three_way.prefill is not None:
            line += (f", prefill {three_way.prefill.avg_ts:.1f} / {local.prefill.avg_ts:.1f} = "
                     f"{three_way.prefill.avg_ts / local.prefill.avg_ts:.2f}")  # fmt: skip
        print(line, flush=True)
    print(f"whole run {time.perf_counter() - started:.0f} s")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--tls-sender":
        _tls_sender(Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096]
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=16,
        help="generated per prompt (16: decode over 15 intervals; 4 gave 3, too few)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4352, help="context per session (4352)")
    parser.add_argument("--first-layers", type=int, help="A's layers [0, N) (11 of every 32 layers)")
    parser.add_argument("--tls-mib", type=int, default=512)
    parser.add_argument("--no-monolithic", action="store_true")
    parser.add_argument("--no-mesh", action="store_true", help="monolithic llama-cpp-python alone")
    parser.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers to offload (0)")
    parser.add_argument("--size", choices=sorted(SIZES), default="llama3-8b", help="bench/random_model.py's")
    rpc = parser.add_mutually_exclusive_group()
    rpc.add_argument("--no-rpc", action="store_true", help="no llama.cpp RPC anchor")
    rpc.add_argument("--build-rpc", action="store_true", help="build the anchor's tools first if needed")
    parser.add_argument("--rpc-prompt", type=int, default=64, help="the anchor's prefill test, tokens (64)")
    parser.add_argument("--rpc-tokens", type=int, default=16, help="the anchor's decode test, tokens (16)")
    parser.add_argument(
        "--rpc-depth", type=int, help="the anchor's context depth (the shortest --prompt-tokens)"
    )
    parser.add_argument("--rpc-reps", type=int, default=2, help="the anchor's repetitions (2)")
    args = parser.parse_args()
    if args.rpc_depth is None:
        args.rpc_depth = min(args.prompt_tokens)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
