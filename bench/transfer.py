"""Transfer benchmark: a slice's tensors over ARTIFACT streams against raw aioquic bulk, one run.

    python bench/transfer.py [--layers 6:12] [--rounds 3] [--decode-rounds 10] [--decode-tokens 24] [--threads 2]

Measured in one run, servers in child processes and the fetcher in this one:

* raw      aioquic's own asyncio API, default settings, no framing: the server writes as
           many bytes as the slice holds on one stream and the client reads them. Baseline.
* 1 source a meshnode node (real Node, real QUIC, mutual auth) serving Gemma 3 270M with the
           upload rate limit off; this process joins the mesh and fetch_tensors() the layer
           range's tensors (verified, journaled, into a fresh sparse store each round).
* 2 sources the same from two serving nodes at once.
* decode   a serving node that also decodes (a real LlamaShardEngine, whole model, greedy,
           in a thread as a node's engine runs) is timed per token without and with this
           process fetching from it continuously at the default upload rate.

Prints medians and the ratios: transfer/raw (target >= 0.8 with one source) and the decode
slowdown while uploading (target <= 10%). On one machine the fetcher's own CPU competes with
the serving peer's decode, which a real joiner on another machine would not: the slowdown
measured here is an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from aioquic.asyncio import connect, serve  # noqa: E402
from aioquic.quic.configuration import QuicConfiguration  # noqa: E402
from helpers.mesh_nodes import fast_config, invite_from, start_first_node, start_invited_node  # noqa: E402

from engines.default_model import default_model_path  # noqa: E402
from engines.engine_guard import choose_weight_repack  # noqa: E402
from engines.engine_probe import ProbeTarget  # noqa: E402
from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest  # noqa: E402
from engines.llama_engine import LlamaShardEngine  # noqa: E402
from engines.model_manifest import cached_manifest  # noqa: E402
from engines.openmp_wait import SHORT_SPIN_ENV  # noqa: E402
from engines.weight_repack import WeightRepack  # noqa: E402
from meshnode.artifacts.fetcher import fetch_manifest, fetch_tensors  # noqa: E402
from meshnode.artifacts.holdings import FullModel, Holdings  # noqa: E402
from meshnode.artifacts.server import ArtifactServer  # noqa: E402
from meshnode.artifacts.store import ArtifactStore  # noqa: E402
from meshnode.artifacts.upload_limit import DEFAULT_UPLOAD_BYTES_PER_S, UploadLimiter  # noqa: E402
from meshnode.identity import NodeIdentity  # noqa: E402
from meshnode.membership.credentials import decode_invite_token, encode_invite_token  # noqa: E402
from meshnode.transport.quic_connection import self_signed_certificate  # noqa: E402
from meshnode.wire.framing import ALPN  # noqa: E402

RAW_WRITE = 256 * 1024


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# -- child processes ----------------------------------------------------------------------------


async def raw_server() -> None:
    """aioquic serving ``N`` bytes on each stream that sends the 8-byte count N."""
    identity = NodeIdentity.generate()
    config = QuicConfiguration(
        is_client=False,
        alpn_protocols=[ALPN],
        certificate=self_signed_certificate(identity),
        private_key=identity.private_key,
    )
    block = bytes(RAW_WRITE)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = int.from_bytes(await reader.readexactly(8), "little")
        while left:
            size = min(left, RAW_WRITE)
            writer.write(block[:size])  # no backpressure in aioquic's stream API: it buffers
            left -= size
            await asyncio.sleep(0)
        writer.write_eof()

    tasks: set[asyncio.Task[None]] = set()

    def on_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await serve("127.0.0.1", 0, configuration=config, stream_handler=on_stream)
    print(json.dumps({"port": server._transport.get_extra_info("sockname")[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


class DecodeTimer:
    """A whole-model engine decoding greedily in its own thread, timed per token on request."""

    def __init__(self, model: Path, threads: int, repack: bool) -> None:
        self.engine = LlamaShardEngine()
        self.engine.load(
            LoadRequest(str(model), n_ctx=512, n_seq_max=1, n_threads=threads, weight_repack=repack)
        )
        self.prompt = tuple(range(1000, 1016))

    def measure(self, tokens: int) -> float:
        """Median milliseconds per decode step over ``tokens`` steps after a fresh prefill."""
        key = SessionKey("bench", 0)
        self.engine.release(key)
        result = self.engine.prefill(StepRequest(key, 0, token_ids=self.prompt, sampling=GREEDY))
        token, position, times = result.token_id, len(self.prompt), []
        for _ in range(tokens):
            started = time.perf_counter()
            result = self.engine.decode(
                StepRequest(key, position, token_ids=(token,), expected_past_len=position, sampling=GREEDY)
            )
            times.append(time.perf_counter() - started)
            token, position = result.token_id, position + 1
        return statistics.median(times) * 1000


async def source_node(args: argparse.Namespace) -> None:
    """A node serving the model's artifacts; with --decode, also the decode timer (stdin-driven)."""
    model = Path(args.model)
    with tempfile.TemporaryDirectory() as data_dir:
        node = await start_invited_node(Path(data_dir), fast_config(), decode_invite_token(args.invite))
        holdings = Holdings()
        holdings.add(FullModel(model))
        rate = DEFAULT_UPLOAD_BYTES_PER_S if args.rate is None else args.rate
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=rate)).register(node)
        timer = DecodeTimer(model, args.threads, args.repack) if args.decode else None
        if timer is not None:
            timer.measure(8)  # warm up
        print(json.dumps({"node_id": node.node_id.hex()}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            assert timer is not None, "only a decode node takes commands"
            # The engine runs in a thread of its own, as a node's engine thread does.
            result: list[float] = []
            tokens = int(line)
            # CPU this thread (the event loop: every upload's QUIC work) spends meanwhile.
            cpu_before, wall_before = time.thread_time(), time.perf_counter()
            worker = threading.Thread(target=lambda: result.append(timer.measure(tokens)))  # noqa: B023 -- joined below
            worker.start()
            await loop.run_in_executor(None, worker.join)
            loop_cpu = (time.thread_time() - cpu_before) / (time.perf_counter() - wall_before)
            print(json.dumps({"ms_per_token": result[0], "loop_cpu": loop_cpu}), flush=True)
        await node.shutdown()


# -- the measuring process ----------------------------------------------------------------------


class Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, *args: str) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        return cls(process)

    async def reply(self) -> dict:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), 600)
        if not line:
            raise RuntimeError(f"child exited ({await self.process.wait()})")
        return json.loads(line)

    async def ask(self, line: str) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        return await self.reply()

    async def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def raw_download(port: int, nbytes: int) -> float:
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
    async with connect("127.0.0.1", port, configuration=config) as client:
        reader, writer = await client.create_stream()
        started = time.perf_counter()
        writer.write(nbytes.to_bytes(8, "little"))
        received = 0
        while data := await reader.read(1 << 20):
            received += len(data)
        elapsed = time.perf_counter() - started
    assert received == nbytes
    return nbytes / elapsed


async def mesh_download(node, manifest, blob, names, sources, scratch: Path) -> float:
    shutil.rmtree(scratch, ignore_errors=True)
    with ArtifactStore(scratch).open(manifest, blob) as partial:
        started = time.perf_counter()
        report = await fetch_tensors(node.get_link, partial, names, sources)
        elapsed = time.perf_counter() - started
        assert partial.verified >= frozenset(names)
    return sum(manifest.tensor(n).nbytes for n in report.fetched) / elapsed


def slice_names(manifest, start: int, end: int) -> list[str]:
    prefixes = tuple(f"blk.{i}." for i in range(start, end))
    return [t.name for t in manifest.tensors if t.name.startswith(prefixes)]


def mbit(rate: float) -> str:
    return f"{rate * 8 / 1e6:6.1f} Mbit/s"


async def measure(args: argparse.Namespace) -> None:
    model = Path(args.model)
    manifest = cached_manifest(model)
    start, end = (int(x) for x in args.layers.split(":"))
    names = slice_names(manifest, start, end)
    nbytes = sum(manifest.tensor(n).nbytes for n in names)
    print(f"{model.name}: layers [{start}, {end}) = {len(names)} tensors, {nbytes / (1 << 20):.1f} MiB")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        node = await start_first_node(tmp_path)
        children: list[Child] = []
        try:
            raw = await Child.start("raw-server")
            children.append(raw)
            raw_port = (await raw.reply())["port"]
            token = encode_invite_token(invite_from(node))
            common = ["--model", str(model), "--invite", token, "--threads", str(args.threads)]
            common += ["--repack" if args.repack else "--no-repack"]
            unlimited = ["--rate", "0"]
            sources = []
            for _ in range(2):
                child = await Child.start("source", *common, *unlimited)
                children.append(child)
                sources.append(bytes.fromhex((await child.reply())["node_id"]))
            decode_rate = DEFAULT_UPLOAD_BYTES_PER_S if args.decode_rate is None else args.decode_rate
            decoder = await Child.start("source", *common, "--decode", "--rate", str(decode_rate))
            children.append(decoder)
            decode_id = bytes.fromhex((await decoder.reply())["node_id"])
            manifest_, blob = await fetch_manifest(node.get_link, manifest.root, sources)
            assert manifest_ == manifest

            if not args.skip_throughput:
                await throughput(args, node, manifest, blob, names, nbytes, raw_port, sources, tmp_path)
            if args.fetcher_nice:
                # The joiner would be another machine; on this one, let the serving peer's
                # decode have the CPU before the fetching process does.
                os.nice(args.fetcher_nice)
            idle, busy, uploaded, idle_cpu, busy_cpu = [], [], [], [], []
            for _ in range(args.decode_rounds):
                answer = await decoder.ask(str(args.decode_tokens))
                idle.append(answer["ms_per_token"])
                idle_cpu.append(answer["loop_cpu"])
                stop = asyncio.Event()
                upload = asyncio.create_task(
                    keep_fetching(node, manifest, blob, names, decode_id, tmp_path / "u", stop, uploaded)
                )
                await asyncio.sleep(0.5)  # the upload is under way before the timing starts
                answer = await decoder.ask(str(args.decode_tokens))
                busy.append(answer["ms_per_token"])
                busy_cpu.append(answer["loop_cpu"])
                stop.set()
                await upload
            idle_ms, busy_ms = statistics.median(idle), statistics.median(busy)
            # Each round's uploading block against the idle block just before it, so load
            # that drifts over the run cancels.
            slowdown = statistics.median(b / i for b, i in zip(busy, idle, strict=True)) - 1
            rate = sum(b for b, _ in uploaded) / sum(s for _, s in uploaded)
            limit = "default " if args.decode_rate is None else ""
            print(
                f"decode while idle    {idle_ms:.2f} ms/token; while uploading at the {limit}"
                f"{decode_rate / (1 << 20):.1f} MiB/s limit (measured {mbit(rate)}): "
                f"{busy_ms:.2f} ms/token, median of rounds {slowdown * 100:+.1f}% (target <= +10%)"
            )
            print(f"  rounds: idle {[round(x, 2) for x in idle]}, uploading {[round(x, 2) for x in busy]}")
            cost = statistics.median(busy_cpu) - statistics.median(idle_cpu)
            print(f"  the serving node's event loop spent {cost * 100:.1f}% of a core more while uploading")
        finally:
            for child in children:
                await child.stop()
            await node.shutdown()


async def throughput(args, node, manifest, blob, names, nbytes, raw_port, sources, tmp_path) -> None:
    """Raw aioquic bulk against the slice fetched from one and from two sources, rounds interleaved."""
    raw_rates, one_rates, two_rates = [], [], []
    await mesh_download(node, manifest, blob, names, sources[:1], tmp_path / "s")  # warm links
    for _ in range(args.rounds):
        raw_rates.append(await raw_download(raw_port, nbytes))
        one_rates.append(await mesh_download(node, manifest, blob, names, sources[:1], tmp_path / "s"))
        two_rates.append(await mesh_download(node, manifest, blob, names, sources, tmp_path / "s"))
    raw_rate, one, two = (statistics.median(r) for r in (raw_rates, one_rates, two_rates))
    print(f"raw aioquic bulk     {mbit(raw_rate)}")
    print(f"slice, 1 source      {mbit(one)}  {one / raw_rate:.2f}x raw (target >= 0.80)")
    print(f"slice, 2 sources     {mbit(two)}  {two / raw_rate:.2f}x raw, {two / one:.2f}x 1 source")
    print(
        f"  rounds (Mbit/s): raw {[round(r * 8e-6, 1) for r in raw_rates]}, "
        f"1 source {[round(r * 8e-6, 1) for r in one_rates]}, 2 sources {[round(r * 8e-6, 1) for r in two_rates]}"
    )


async def keep_fetching(node, manifest, blob, names, source, scratch, stop, uploaded) -> None:
    """Fetch the slice from ``source`` over and over until ``stop``; records (bytes, seconds)."""
    while not stop.is_set():
        shutil.rmtree(scratch, ignore_errors=True)
        with ArtifactStore(scratch).open(manifest, blob) as partial:
            started = time.perf_counter()
            fetch = asyncio.create_task(fetch_tensors(node.get_link, partial, names, [source]))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not fetch.done():
                fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetch
            stopped.cancel()
            uploaded.append(
                (sum(manifest.tensor(n).nbytes for n in partial.verified), time.perf_counter() - started)
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", default="measure", choices=["measure", "raw-server", "source"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--layers", default="6:12")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--decode-rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--invite")
    parser.add_argument("--rate", type=float, default=None, help="upload bytes/s (0: unlimited)")
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--decode-rate", type=float, default=None, help="the decoding peer's upload limit")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--fetcher-nice", type=int, default=0, help="niceness of this process while decode is timed"
    )
    parser.add_argument("--repack", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    os.environ.update(SHORT_SPIN_ENV)
    if args.role == "raw-server":
        coro = raw_server()
    elif args.role == "source":
        coro = source_node(args)
    else:
        args.model = args.model or str(default_model_path(progress=True))
        if args.repack is None:
            target = ProbeTarget(Path(args.model), threads=args.threads)
            args.repack = choose_weight_repack(WeightRepack.AUTO, target).weight_repack
        coro = measure(args)
    loop = new_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


if __name__ == "__main__":
    main()
