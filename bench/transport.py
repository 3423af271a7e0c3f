"""Transport benchmark: raw aioquic against meshnode's framing + dispatch, on loopback, one run.

    python bench/transport.py [--rounds 2000] [--bulk-mib 64]

The server runs in a child process (the client in this one), for both stacks:

* raw     aioquic's own asyncio API (serve/connect, StreamReader/StreamWriter),
          default settings, no framing: the baseline.
* meshnode QuicEndpoint (mutual Ed25519 auth, bounded buffers, app-driven credit)
          + Dispatcher + FramedStream ([len][body] frames, type byte per stream).

Measured: small round trip (64-byte echo) on one long-lived stream and on a fresh
stream per request (what unary mesh calls do), and one-way bulk throughput
(the server acknowledges the byte count at the end). Both servers run at once and
the client alternates between the stacks in small batches, so background load on
a shared machine hits both alike. Prints medians and the meshnode/raw ratios. Targets: <= 1.20x round trip, >= 0.80x bulk throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aioquic.asyncio import connect, serve  # noqa: E402
from aioquic.quic.configuration import QuicConfiguration  # noqa: E402

from meshnode.identity import NodeIdentity  # noqa: E402
from meshnode.mesh.dispatcher import Dispatcher  # noqa: E402
from meshnode.transport.framed import FramedStream  # noqa: E402
from meshnode.transport.quic import QuicEndpoint  # noqa: E402
from meshnode.transport.quic_connection import self_signed_certificate  # noqa: E402
from meshnode.wire.framing import ALPN, StreamType  # noqa: E402

SMALL = 64
BULK_FRAME = 256 * 1024
ECHO, BULK = b"E", b"B"
COUNT = struct.Struct("<Q")


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# -- servers (child process) ------------------------------------------------------------------


async def raw_server(port_file: Path) -> None:
    identity = NodeIdentity.generate()
    config = QuicConfiguration(
        is_client=False,
        alpn_protocols=[ALPN],
        certificate=self_signed_certificate(identity),
        private_key=identity.private_key,
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = await reader.readexactly(1)
        if kind == ECHO:
            while data := await reader.read(65536):
                writer.write(data)
        else:
            total = 0
            while data := await reader.read(1 << 20):
                total += len(data)
            writer.write(COUNT.pack(total))
        writer.write_eof()

    tasks: set[asyncio.Task[None]] = set()

    def stream_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(handle(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await serve("127.0.0.1", 0, configuration=config, stream_handler=stream_handler)
    port_file.write_text(str(server._transport.get_extra_info("sockname")[1]))
    await asyncio.Event().wait()


async def mesh_server(port_file: Path) -> None:
    identity = NodeIdentity.generate()

    async def echo(stream: FramedStream) -> None:
        while (frame := await stream.recv_frame()) is not None:
            await stream.send_frame(frame)

    async def bulk(stream: FramedStream) -> None:
        total = 0
        while (frame := await stream.recv_frame()) is not None:
            total += len(frame)
        await stream.send_frame(COUNT.pack(total))

    dispatcher = Dispatcher(is_admitted=lambda peer: True)
    dispatcher.register(StreamType.PROBE, echo)
    dispatcher.register(StreamType.SHARD_SESSION, bulk)

    class Handler:
        def link_established(self, link) -> None:
            pass

        def stream_accepted(self, link, stream) -> None:
            dispatcher.accept(stream)

        def link_closed(self, link, reason) -> None:
            pass

    endpoint = await QuicEndpoint.listen(identity, Handler(), "127.0.0.1", 0)
    port_file.write_text(f"{endpoint.local_address[1]} {identity.node_id.hex()}")
    await asyncio.Event().wait()


# -- clients (this process) ---------------------------------------------------------------------


class RawClient:
    """aioquic's client API; the 64-byte echo needs no framing: it reads exactly 64 bytes back."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def __aenter__(self) -> RawClient:
        config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
        self._context = connect("127.0.0.1", self.port, configuration=config)
        self.client = await self._context.__aenter__()
        self.reader, self.writer = await self.client.create_stream()
        self.writer.write(ECHO)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._context.__aexit__(*exc)

    async def echo(self, payload: bytes) -> None:
        self.writer.write(payload)
        await self.reader.readexactly(len(payload))

    async def fresh_echo(self, payload: bytes) -> None:
        reader, writer = await self.client.create_stream()
        writer.write(ECHO + payload)
        writer.write_eof()
        await reader.readexactly(len(payload))

    async def bulk(self, chunk: bytes, count: int) -> None:
        reader, writer = await self.client.create_stream()
        writer.write(BULK)
        for _ in range(count):
            writer.write(chunk)  # aioquic buffers without bound: there is no backpressure to wait on
        writer.write_eof()
        (total,) = COUNT.unpack(await reader.readexactly(COUNT.size))
        assert total == len(chunk) * count


class MeshClient:
    """meshnode's QuicEndpoint + FramedStream against a Dispatcher-served endpoint."""

    def __init__(self, port: int, server_id: bytes) -> None:
        self.port = port
        self.server_id = server_id

    async def __aenter__(self) -> MeshClient:
        class Refuse:
            def link_established(self, link) -> None:
                pass

            def stream_accepted(self, link, stream) -> None:
                stream.reset(1)

            def link_closed(self, link, reason) -> None:
                pass

        self.endpoint = await QuicEndpoint.listen(NodeIdentity.generate(), Refuse(), "127.0.0.1", 0)
        self.link = await self.endpoint.dial(f"127.0.0.1:{self.port}", self.server_id)
        self.stream = await self.link.open_stream(StreamType.PROBE)
        return self

    async def __aexit__(self, *exc) -> None:
        self.endpoint.close()
        await asyncio.sleep(0.05)

    async def echo(self, payload: bytes) -> None:
        await self.stream.send_frame(payload)
        await self.stream.recv_frame()

    async def fresh_echo(self, payload: bytes) -> None:
        stream = await self.link.open_stream(StreamType.PROBE)
        await stream.send_frame(payload)
        stream.finish()
        await stream.recv_frame()
        stream.close()

    async def bulk(self, chunk: bytes, count: int) -> None:
        stream = await self.link.open_stream(StreamType.SHARD_SESSION)
        for _ in range(count):
            await stream.send_frame(chunk)  # waits while too much is unacknowledged
        stream.finish()
        (total,) = COUNT.unpack(await stream.recv_frame())
        stream.close()
        assert total == len(chunk) * count


async def timed(awaitable) -> float:
    start = time.perf_counter()
    await awaitable
    return time.perf_counter() - start


async def measure(
    raw: RawClient, mesh: MeshClient, rounds: int, bulk_bytes: int, trials: int, bulk_rounds: int
) -> dict:
    """Alternate the two stacks in small batches, so background load hits both alike."""
    payload = os.urandom(SMALL)
    chunk = os.urandom(BULK_FRAME)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"rtt_stream": [], "rtt_fresh": [], "bulk_s": []} for name in ("raw", "mesh")
    }
    clients = {"raw": raw, "mesh": mesh}
    for client in clients.values():  # warm-up
        for _ in range(50):
            await client.echo(payload)
            await client.fresh_echo(payload)
    batch = max(1, rounds // trials)
    for _ in range(trials):
        for name, client in clients.items():
            samples[name]["rtt_stream"] += [await timed(client.echo(payload)) for _ in range(batch)]
            samples[name]["rtt_fresh"] += [await timed(client.fresh_echo(payload)) for _ in range(batch // 4)]
    for _ in range(bulk_rounds):
        for name, client in clients.items():
            samples[name]["bulk_s"].append(await timed(client.bulk(chunk, bulk_bytes // BULK_FRAME)))
    return {
        name: {
            "rtt_stream_us": statistics.median(s["rtt_stream"]) * 1e6,
            "rtt_fresh_stream_us": statistics.median(s["rtt_fresh"]) * 1e6,
            "bulk_mbit_s": bulk_bytes * 8 / statistics.median(s["bulk_s"]) / 1e6,
        }
        for name, s in samples.items()
    }


# -- driver ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def server_process(kind: str):
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        process = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port-file", str(port_file)])
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"{kind} server did not start")
                time.sleep(0.05)
            time.sleep(0.1)
            yield port_file.read_text().split()
        finally:
            process.terminate()
            process.wait(10)


async def run_both(raw_port: int, mesh_port: int, mesh_id: bytes, args: argparse.Namespace) -> dict:
    async with RawClient(raw_port) as raw, MeshClient(mesh_port, mesh_id) as mesh:
        return await measure(
            raw, mesh, args.rounds, args.bulk_mib * 1024 * 1024, args.trials, args.bulk_rounds
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2000, help="small round trips per measurement")
    parser.add_argument("--bulk-mib", type=int, default=16, help="MiB per bulk transfer")
    parser.add_argument("--bulk-rounds", type=int, default=6, help="bulk transfers per stack (median)")
    parser.add_argument(
        "--trials", type=int, default=10, help="alternating batches per round-trip measurement"
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--serve", choices=["raw", "mesh"], help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        server = raw_server if args.serve == "raw" else mesh_server
        loop = new_loop()
        loop.run_until_complete(server(args.port_file))
        return

    with server_process("raw") as raw_info, server_process("mesh") as mesh_info:
        loop = new_loop()
        try:
            results = loop.run_until_complete(
                run_both(int(raw_info[0]), int(mesh_info[0]), bytes.fromhex(mesh_info[1]), args)
            )
        finally:
            loop.close()
    raw, mesh = results["raw"], results["mesh"]
    rows = [
        ("small round trip, one stream (us)", "rtt_stream_us", "lower", 1.20),
        ("small round trip, stream per request (us)", "rtt_fresh_stream_us", "lower", 1.20),
        ("bulk throughput (Mbit/s)", "bulk_mbit_s", "higher", 0.80),
    ]
    print(
        f"transport on loopback: {args.rounds} round trips of {SMALL} B, {args.bulk_rounds} bulk transfers of "
        f"{args.bulk_mib} MiB (medians; the stacks alternate batch by batch)"
    )
    print(f"{'':44} {'raw aioquic':>12} {'meshnode':>12} {'ratio':>8}  target")
    for label, key, better, target in rows:
        ratio = mesh[key] / raw[key]
        ok = ratio <= target if better == "lower" else ratio >= target
        bound = "<=" if better == "lower" else ">="
        verdict = "ok" if ok else "MISSED"
        print(f"{label:44} {raw[key]:12.1f} {mesh[key]:12.1f} {ratio:8.2f}  {bound} {target:.2f} {verdict}")
    if args.json:
        print(json.dumps({"raw": raw, "meshnode": mesh}))


if __name__ == "__main__":
    main()
