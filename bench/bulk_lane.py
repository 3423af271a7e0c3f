"""Bulk lane benchmark: a slice's tensors fetched over the bulk lane (TLS/TCP), over QUIC, and
raw TLS over TCP between two processes, in one run.

    python bench/bulk_lane.py [--model PATH] [--layers 0:18 | --whole-model] [--rounds 3] [--quic-rounds 1]

Servers in child processes, the fetcher in this one, all on loopback:

* raw TLS  Python's ssl on asyncio, TLS 1.3 with the lane's own certificates and contexts, no
           framing: the server writes as many bytes as the slice holds, the client reads them.
           The baseline (what the link and OpenSSL allow between two Python processes).
* lane     a meshnode node serving the model (idle: unpaced, 256 KiB chunks; its bulk lane listening);
           this process joins the mesh and fetch_tensors() the range's tensors through
           BulkLanes (TLS/TCP, verified and journaled into a fresh store each round).
* QUIC     the same fetch over the node's QUIC link (node.get_link), as before the lane.

Prints medians and the ratios lane/raw TLS (issue 53's target: >= 0.5) and QUIC/raw TLS, the
CPU seconds each raw TLS download and each lane fetch took (user + system: this process with its
threads, and the serving child), and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.mesh_nodes import fast_config, invite_from, start_first_node, start_invited_node  # noqa: E402

from engines.default_model import default_model_path  # noqa: E402
from engines.model_manifest import cached_manifest  # noqa: E402
from meshnode.app.bulk_lane import NodeBulkLane  # noqa: E402
from meshnode.artifacts.fetcher import fetch_tensors  # noqa: E402
from meshnode.artifacts.holdings import FullModel, Holdings  # noqa: E402
from meshnode.artifacts.server import ArtifactServer  # noqa: E402
from meshnode.artifacts.store import ArtifactStore  # noqa: E402
from meshnode.artifacts.upload_limit import UploadLimiter  # noqa: E402
from meshnode.identity import NodeIdentity  # noqa: E402
from meshnode.membership.credentials import decode_invite_token, encode_invite_token  # noqa: E402
from meshnode.transport.tls_lane import READ_BUFFER_BYTES, LaneContexts, authenticated_peer  # noqa: E402

RAW_WRITE = 256 * 1024


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# -- child processes ----------------------------------------------------------------------------


async def raw_tls_server(client_id: bytes) -> None:
    """TLS over TCP with the lane's contexts: ``N`` bytes to each connection that sends the count N."""
    contexts = LaneContexts(NodeIdentity.generate())
    contexts.trust([client_id])
    block = bytes(RAW_WRITE)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = int.from_bytes(await reader.readexactly(8), "little")
        while left:
            size = min(left, RAW_WRITE)
            writer.write(block[:size])
            await writer.drain()
            left -= size
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=contexts.server)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"port": port, "node_id": contexts.identity.node_id.hex()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def source_node(model: Path, invite: str) -> None:
    """A node serving the model's artifacts over QUIC and its bulk lane, as an idle node does: no
    sessions to protect, so its uploads go unpaced in the protocol's largest chunks (without
    ``is_busy`` a limiter counts as always pacing, and the server sends 64 KiB chunks)."""
    with tempfile.TemporaryDirectory() as data_dir:
        node = await start_invited_node(Path(data_dir), fast_config(), decode_invite_token(invite))
        holdings = Holdings()
        holdings.add(FullModel(model))
        server = ArtifactServer(holdings, UploadLimiter(bytes_per_s=0, is_busy=lambda: False))
        server.register(node)
        lane = NodeBulkLane(node, server)
        await lane.start(node)
        assert lane.listening
        print(json.dumps({"node_id": node.node_id.hex()}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await lane.close()
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

    async def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def raw_tls_download(contexts: LaneContexts, port: int, server_id: bytes, nbytes: int) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=contexts.client(server_id), server_hostname="meshnode", limit=READ_BUFFER_BYTES
    )
    assert authenticated_peer(writer) == server_id
    writer.write(nbytes.to_bytes(8, "little"))
    received = 0
    while data := await reader.read(1 << 20):
        received += len(data)
    elapsed = time.perf_counter() - started
    writer.close()
    assert received == nbytes
    return nbytes / elapsed


async def fetch_rate(
    open_link, manifest, blob, names, source: bytes, scratch: Path, meter: CpuMeter | None = None
) -> float:
    shutil.rmtree(scratch, ignore_errors=True)
    with ArtifactStore(scratch).open(manifest, blob) as partial:
        started = time.perf_counter()
        with meter or contextlib.nullcontext():
            report = await fetch_tensors(open_link, partial, names, [source])
        elapsed = time.perf_counter() - started
        assert partial.verified >= frozenset(names)
    return sum(manifest.tensor(n).nbytes for n in report.fetched) / elapsed


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process, all its threads, or of child ``pid`` (Linux)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of this process and of one child while a block runs, appended to ``seconds``."""

    def __init__(self, child: Child, seconds: dict[str, list[float]], name: str) -> None:
        self.pid = child.process.pid
        self.here = seconds.setdefault(f"{name} here", [])
        self.there = seconds.setdefault(f"{name} server", [])

    def __enter__(self) -> None:
        self.started = cpu_seconds(), cpu_seconds(self.pid)

    def __exit__(self, *exc: object) -> None:
        self.here.append(cpu_seconds() - self.started[0])
        self.there.append(cpu_seconds(self.pid) - self.started[1])


def load_average() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def slice_names(manifest, start: int, end: int) -> list[str]:
    prefixes = tuple(f"blk.{i}." for i in range(start, end))
    return [t.name for t in manifest.tensors if t.name.startswith(prefixes)]


def mb(rate: float) -> str:
    return f"{rate / 1e6:7.1f} MB/s"


async def measure(args: argparse.Namespace) -> None:
    from meshnode.artifacts.fetcher import fetch_manifest

    model = Path(args.model) if args.model else default_model_path()
    manifest = cached_manifest(model)
    start, end = (int(x) for x in args.layers.split(":"))
    names = slice_names(manifest, start, end)
    if args.whole_model:
        # Every tensor, the embeddings among them: per-request costs weigh less.
        names = [t.name for t in manifest.tensors]
    nbytes = sum(manifest.tensor(n).nbytes for n in names)
    print(f"{model.name}: layers [{start}, {end}) = {len(names)} tensors, {nbytes / 1e6:.1f} MB")
    print(f"load average {load_average()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        node = await start_first_node(tmp_path)
        lane = NodeBulkLane(node, ArtifactServer(Holdings()))
        children: list[Child] = []
        try:
            raw = await Child.start("raw-tls-server", "--client-id", node.node_id.hex())
            children.append(raw)
            raw_info = await raw.reply()
            token = encode_invite_token(invite_from(node))
            child = await Child.start("source", "--model", str(model), "--invite", token)
            children.append(child)
            source = bytes.fromhex((await child.reply())["node_id"])
            manifest_, blob = await fetch_manifest(node.get_link, manifest.root, [source])
            rates: dict[str, list[float]] = {"raw TLS": [], "lane": [], "QUIC": []}
            cpu: dict[str, list[float]] = {}
            for round_ in range(args.rounds):
                with CpuMeter(raw, cpu, "raw TLS"):
                    rates["raw TLS"].append(
                        await raw_tls_download(
                            lane.contexts, raw_info["port"], bytes.fromhex(raw_info["node_id"]), nbytes
                        )
                    )
                scratch = tmp_path / f"store-{round_}"
                meter = CpuMeter(child, cpu, "lane")
                rates["lane"].append(
                    await fetch_rate(lane.lanes.open_link, manifest_, blob, names, source, scratch, meter)
                )
                if round_ < args.quic_rounds:
                    rates["QUIC"].append(
                        await fetch_rate(node.get_link, manifest_, blob, names, source, scratch)
                    )
                print(
                    f"round {round_ + 1}: "
                    + ", ".join(f"{k} {mb(v[-1])}" for k, v in rates.items() if len(v) > round_)
                )
            assert lane.lanes.lanes[source].startswith("TLS/TCP"), lane.lanes.lanes
            medians = {k: statistics.median(v) for k, v in rates.items() if v}
            for name, rate in medians.items():
                print(f"{name:8s} median {mb(rate)}")
            print(f"lane / raw TLS: {medians['lane'] / medians['raw TLS']:.2f} (target >= 0.5)")
            if "QUIC" in medians:
                print(f"QUIC / raw TLS: {medians['QUIC'] / medians['raw TLS']:.3f}")
            for name, seconds in cpu.items():
                print(
                    f"CPU s {name:15s} median {statistics.median(seconds):.2f} ({', '.join(f'{s:.2f}' for s in seconds)})"
                )
            print(f"load average {load_average()}")
        finally:
            for child in children:
                await child.stop()
            await node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", default="measure", choices=["measure", "raw-tls-server", "source"])
    parser.add_argument("--model", default=None, help="a GGUF (default: Gemma 3 270M)")
    parser.add_argument("--layers", default="0:18")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quic-rounds", type=int, default=1, help="QUIC fetches are slow: fewer of them")
    parser.add_argument("--whole-model", action="store_true", help="every tensor, not --layers")
    parser.add_argument("--invite")
    parser.add_argument("--client-id")
    args = parser.parse_args()
    if args.role == "raw-tls-server":
        coro = raw_tls_server(bytes.fromhex(args.client_id))
    elif args.role == "source":
        coro = source_node(Path(args.model), args.invite)
    else:
        coro = measure(args)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(coro)


if __name__ == "__main__":
    main()
