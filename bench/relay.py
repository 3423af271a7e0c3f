"""Relay cost against direct QUIC, measured in the same run on loopback.

    python bench/relay.py [--round-trips 1000] [--seconds 2] [--relay-delay-ms D] [--relay-loss-percent P]

Three processes: the relay (``python -m relay``), a peer node B (echo/sink,
reachable both directly over QUIC and through the relay with sealed relayed
links) and this process (node A and the load generator), all on uvloop.

1. Decode-step round trip: A sends a decode-step-sized frame (2 700 bytes: 640
   float32 hidden values of Gemma 3 270M plus envelope) on a stream and B answers
   64 bytes, direct QUIC vs a sealed relayed link. Target: relayed median
   <= 2 x direct median + 1 ms.
2. The same round trip while another stream of the same relayed link pushes a transfer to
   B's sink (head-of-line blocking: the link's channels share one relay connection in order),
   against the idle round trip above.
3. Relay forwarding throughput with 1, 10 and 100 concurrent senders (this
   process), each streaming 16 KiB relay frames to its own receiver (a fourth
   process), raw relay sessions without sealing (the relay's own cost), in
   frames/s and MB/s, against one direct QUIC stream from A to B's sink moving
   the same frames. The relay process's CPU share is printed too: on a machine
   with fewer cores than busy processes, the Python load generators, not the
   relay, are often the limit.

With ``--relay-delay-ms D``, A reaches the relay through ``bench/udp_delay.py``, which holds
each datagram D ms each way (a path with delay where the kernel has no netem), and with
``--relay-loss-percent P`` drops P% of them each way; only parts 1 and 2 run, and the direct
path in part 1 has neither.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and `bench/relay.py`
# would shadow the `relay` package it measures.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
# ruff: noqa: E402

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import tempfile
import time

import uvloop

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey, certificate_proof, issue_certificate
from meshnode.relaylink.client import RelayDialer, RelaySession
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicEndpoint
from meshnode.wire.framing import StreamType

REQUEST_BYTES = 2700
REPLY_BYTES = 64
BULK_FRAME = 16 * 1024
REPO = Path(__file__).resolve().parents[1]


class PeerHandler:
    """Node B: PROBE streams echo a fixed-size reply per frame; other streams are sinks."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def link_established(self, link: PeerLink) -> None:
        pass

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(stream))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, stream: MeshStream) -> None:
        framed = FramedStream(stream, expect_stream_type=True)
        with contextlib.suppress(Exception):
            kind = await framed.read_stream_type(5)
            reply = b"r" * REPLY_BYTES
            received = 0
            while (frame := await framed.recv_frame()) is not None:
                if kind == StreamType.PROBE:
                    await framed.send_frame(reply)
                else:
                    received += len(frame)
            await framed.send_frame(str(received).encode())
            framed.finish()


def member(mesh_key: MeshKey, seed: bytes | None = None) -> tuple[NodeIdentity, object]:
    identity = NodeIdentity.from_seed(seed) if seed else NodeIdentity.generate()
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time()
    )
    return identity, certificate_proof(certificate)


async def run_peer(mesh_seed: bytes, node_seed: bytes, relay: Endpoint) -> None:
    """The peer process: direct QUIC endpoint + relayed links, until stdin closes."""
    mesh_key = MeshKey.from_seed(mesh_seed)
    identity, proof = member(mesh_key, node_seed)
    handler = PeerHandler()
    endpoint = await QuicEndpoint.listen(identity, handler, "127.0.0.1", 0)
    links = RelayLinks(
        identity, handler, mesh_id=mesh_key.mesh_id, proof_for=lambda _r: proof, local_host="127.0.0.1"
    )
    await links.add_relays([relay])
    await links.wait_registered(10)
    print(f"peer {endpoint.local_address[1]}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await links.close()
    endpoint.close()


def start_relay(mesh_id: str, data_dir: str) -> tuple[subprocess.Popen[str], Endpoint]:
    process = subprocess.Popen(
        [sys.executable, "-m", "relay", "--listen", "127.0.0.1:0", "--mesh", mesh_id, "--data-dir", data_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None
    relay_id = bytes.fromhex(process.stdout.readline().split(":", 1)[1].strip())
    address = process.stdout.readline().rsplit(" ", 1)[1].strip()
    return process, Endpoint(relay_id, address)


def start_delay_proxy(
    relay: Endpoint, one_way_ms: float, loss_percent: float = 0.0
) -> tuple[subprocess.Popen[str], Endpoint]:
    """``bench/udp_delay.py`` in front of the relay, and the relay as reached through it."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench" / "udp_delay.py"),
            "0",
            relay.address,
            str(one_way_ms),
            str(loss_percent),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    port = int(process.stdout.readline().split()[1])
    return process, Endpoint(relay.id, f"127.0.0.1:{port}")


async def round_trips(stream: FramedStream, count: int) -> list[float]:
    request = b"h" * REQUEST_BYTES
    for _ in range(max(50, count // 10)):  # warm-up
        await stream.send_frame(request)
        await stream.recv_frame(10)
    samples = []
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        await stream.send_frame(request)
        await stream.recv_frame(10)
        samples.append(clock() - start)
    return samples


async def round_trips_beside_a_transfer(
    probe: FramedStream, bulk: FramedStream, count: int
) -> tuple[list[float], float]:
    """Decode-step round trips on ``probe`` while ``bulk``, a stream on the same link, pushes
    frames to B's sink as fast as its credit allows; the samples and the transfer's bytes/s."""
    frame = b"b" * BULK_FRAME
    sent = [0]

    async def push() -> None:
        while True:
            await bulk.send_frame(frame)
            sent[0] += len(frame)

    pusher = asyncio.ensure_future(push())
    try:
        await asyncio.sleep(0.5)  # the transfer fills its windows first
        start, before = time.perf_counter(), sent[0]
        samples = await round_trips(probe, count)
        rate = (sent[0] - before) / (time.perf_counter() - start)
    finally:
        pusher.cancel()
        await asyncio.gather(pusher, return_exceptions=True)
    return samples, rate


async def direct_bulk(stream: FramedStream, seconds: float) -> float:
    """Bytes/s pushed to B's sink over one direct QUIC stream (B confirms the count)."""
    frame = b"b" * BULK_FRAME
    sent = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        await stream.send_frame(frame)
        sent += len(frame)
    stream.finish()
    received = int(await stream.recv_frame(30) or b"0")
    assert received == sent, (received, sent)
    return sent / (time.perf_counter() - start)


async def open_sessions(
    mesh_key: MeshKey, relay: Endpoint, count: int
) -> tuple[list[RelaySession], list[RelayDialer]]:
    dialers, sessions = [], []
    for _ in range(count):
        identity, proof = member(mesh_key)
        dialer = await RelayDialer.open(identity, host="127.0.0.1")
        dialers.append(dialer)
        sessions.append(await dialer.register(relay, mesh_id=mesh_key.mesh_id, proof=proof))
    return sessions, dialers


async def close_sessions(sessions: list[RelaySession], dialers: list[RelayDialer]) -> None:
    for session in sessions:
        session.close()
    await asyncio.sleep(0.2)
    for dialer in dialers:
        dialer.close()
    await asyncio.sleep(0.1)


async def run_receivers(mesh_seed: bytes, relay: Endpoint, count: int) -> None:
    """Receiver process: ``count`` relay sessions; prints their ids, counts deliveries between
    ``start`` and ``stop`` lines on stdin, then prints the count."""
    sessions, dialers = await open_sessions(MeshKey.from_seed(mesh_seed), relay, count)
    print(" ".join(s.node_id.hex() for s in sessions), flush=True)
    delivered = [0]
    counting = [False]

    async def receive(session: RelaySession) -> None:
        while (message := await session.recv()) is not None:
            if counting[0] and message.WhichOneof("kind") == "deliver":
                delivered[0] += 1

    tasks = [asyncio.ensure_future(receive(s)) for s in sessions]
    loop = asyncio.get_running_loop()
    assert (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "start"
    counting[0] = True
    assert (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "stop"
    counting[0] = False
    print(delivered[0], flush=True)
    for task in tasks:
        task.cancel()
    await close_sessions(sessions, dialers)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def relay_throughput(
    mesh_key: MeshKey, relay: Endpoint, clients: int, seconds: float, relay_pid: int
) -> tuple[float, float, float]:
    """Frames/s and bytes/s delivered with ``clients`` concurrent senders (this process),
    each streaming to its own receiver (another process), and the relay's CPU share."""
    receivers = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--receivers",
            str(clients),
            mesh_key.seed().hex(),
            relay.id.hex(),
            relay.address,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert receivers.stdin is not None and receivers.stdout is not None
    loop = asyncio.get_running_loop()
    destinations = [
        bytes.fromhex(h) for h in (await loop.run_in_executor(None, receivers.stdout.readline)).split()
    ]
    senders, dialers = await open_sessions(mesh_key, relay, clients)
    payload = b"p" * BULK_FRAME

    async def send(sender: RelaySession, destination: bytes) -> None:
        while True:
            await sender.send(destination, 2, payload)

    tasks = [asyncio.ensure_future(send(s, d)) for s, d in zip(senders, destinations, strict=True)]
    await asyncio.sleep(min(1.0, seconds / 2))  # warm-up
    receivers.stdin.write("start\n")
    receivers.stdin.flush()
    start, relay_cpu = time.perf_counter(), cpu_seconds(relay_pid)
    await asyncio.sleep(seconds)
    receivers.stdin.write("stop\n")
    receivers.stdin.flush()
    elapsed = time.perf_counter() - start
    relay_share = (cpu_seconds(relay_pid) - relay_cpu) / elapsed
    frames = int(await loop.run_in_executor(None, receivers.stdout.readline))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await close_sessions(senders, dialers)
    receivers.stdin.close()
    receivers.wait(timeout=10)
    return frames / elapsed, frames * BULK_FRAME / elapsed, relay_share


def ms(value: float) -> str:
    return f"{value * 1000:.3f}"


async def main(args: argparse.Namespace) -> int:
    mesh_key = MeshKey.generate()
    peer_seed = os.urandom(32)
    peer_id = NodeIdentity.from_seed(peer_seed).node_id
    with tempfile.TemporaryDirectory() as tmp:
        relay_process, relay = start_relay(mesh_key.mesh_id, tmp)
        peer = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--peer",
                mesh_key.seed().hex(),
                peer_seed.hex(),
                relay.id.hex(),
                relay.address,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        delay_proxy: subprocess.Popen[str] | None = None
        try:
            assert peer.stdout is not None
            peer_port = int(peer.stdout.readline().split()[1])
            identity, proof = member(mesh_key)
            relay_for_a = relay
            if args.relay_delay_ms or args.relay_loss_percent:
                delay_proxy, relay_for_a = start_delay_proxy(
                    relay, args.relay_delay_ms, args.relay_loss_percent
                )
            endpoint = await QuicEndpoint.listen(identity, PeerHandler(), "127.0.0.1", 0)
            links = RelayLinks(
                identity,
                PeerHandler(),
                mesh_id=mesh_key.mesh_id,
                proof_for=lambda _r: proof,
                local_host="127.0.0.1",
            )
            await links.add_relays([relay_for_a])
            await links.wait_registered(10)
            direct_link = await endpoint.dial(f"127.0.0.1:{peer_port}", peer_id)
            relayed_link = await links.open_link(peer_id)

            print(
                f"decode-step round trip ({REQUEST_BYTES} B request, {REPLY_BYTES} B reply), {args.round_trips} each"
            )
            results = {}
            # Alternate the two paths in blocks so background load hits both alike.
            samples: dict[str, list[float]] = {"direct": [], "relay": []}
            streams = {
                "direct": await direct_link.open_stream(StreamType.PROBE),
                "relay": await relayed_link.open_stream(StreamType.PROBE),
            }
            for _ in range(4):
                for name, stream in streams.items():
                    samples[name] += await round_trips(stream, args.round_trips // 4)
            for name, values in samples.items():
                results[name] = statistics.median(values)
                print(
                    f"  {name:6s} median {ms(results[name])} ms  mean {ms(statistics.fmean(values))} ms  "
                    f"p90 {ms(sorted(values)[int(len(values) * 0.9)])} ms  "
                    f"p99 {ms(sorted(values)[int(len(values) * 0.99)])} ms"
                )
            target = 2 * results["direct"] + 0.001
            ratio = results["relay"] / results["direct"]
            verdict = "meets" if results["relay"] <= target else "MISSES"
            print(
                f"  relay / direct = {ratio:.2f}x; target relay <= 2 x direct + 1 ms = {ms(target)} ms: {verdict}"
            )
            print(f"  sealed frames dropped: {links.frames_dropped}")

            # Head-of-line blocking: one relay connection carries every channel of the link in
            # order, so a step queued behind a transfer's data waits for it.
            count = max(20, args.round_trips // 10)
            print(f"\ndecode-step round trip while the same relayed link carries a transfer, {count} each")
            beside, rate = await round_trips_beside_a_transfer(
                streams["relay"], await relayed_link.open_stream(StreamType.SUBPROTOCOL), count
            )
            idle = statistics.median(samples["relay"])
            busy = statistics.median(beside)
            print(
                f"  idle link (above): median {ms(idle)} ms; beside a transfer at {rate / 1e6:.1f} MB/s: "
                f"median {ms(busy)} ms  p90 {ms(sorted(beside)[int(len(beside) * 0.9)])} ms  "
                f"max {ms(max(beside))} ms  ({busy / idle:.1f}x idle)"
            )

            if delay_proxy is not None:
                await links.close()
                endpoint.close()
                return 0
            print(f"\nforwarding throughput, {BULK_FRAME // 1024} KiB frames, {args.seconds:g} s per run")
            bulk_stream = await direct_link.open_stream(StreamType.SUBPROTOCOL)
            direct_rate = await direct_bulk(bulk_stream, args.seconds)
            print(
                f"  direct QUIC, 1 stream: {direct_rate / BULK_FRAME:9.0f} frames/s  {direct_rate / 1e6:7.1f} MB/s  (baseline)"
            )
            for clients in (1, 10, 100):
                frames_per_s, bytes_per_s, relay_cpu = await relay_throughput(
                    mesh_key, relay, clients, args.seconds, relay_process.pid
                )
                print(
                    f"  relay, {clients:3d} sender(s):  {frames_per_s:9.0f} frames/s  {bytes_per_s / 1e6:7.1f} MB/s  "
                    f"{bytes_per_s / direct_rate:.2f}x direct  (relay process at {relay_cpu:.0%} of a core, "
                    f"{bytes_per_s / 1e6 / max(relay_cpu, 1e-9):.1f} MB per relay CPU-second)"
                )
            await links.close()
            endpoint.close()
        finally:
            if delay_proxy is not None:
                delay_proxy.kill()
            if peer.stdin is not None:
                peer.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.wait(timeout=5)
            peer.kill()
            relay_process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                relay_process.wait(timeout=5)
            relay_process.kill()
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each throughput run")
    parser.add_argument(
        "--relay-delay-ms",
        type=float,
        default=0.0,
        help="hold A's datagrams to and from the relay this long each way (parts 1 and 2 only)",
    )
    parser.add_argument(
        "--relay-loss-percent",
        type=float,
        default=0.0,
        help="and drop this share of them each way (parts 1 and 2 only)",
    )
    parser.add_argument("--receivers", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument(
        "--peer",
        nargs=4,
        metavar=("MESH_SEED", "NODE_SEED", "RELAY_ID", "RELAY_ADDR"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.peer:
        mesh_seed, node_seed, relay_id, relay_address = args.peer
        uvloop.run(
            run_peer(
                bytes.fromhex(mesh_seed),
                bytes.fromhex(node_seed),
                Endpoint(bytes.fromhex(relay_id), relay_address),
            )
        )
        return 0
    if args.receivers:
        count, mesh_seed, relay_id, relay_address = args.receivers
        relay = Endpoint(bytes.fromhex(relay_id), relay_address)
        uvloop.run(run_receivers(bytes.fromhex(mesh_seed), relay, int(count)))
        return 0
    return uvloop.run(main(args))


if __name__ == "__main__":
    sys.exit(cli())
