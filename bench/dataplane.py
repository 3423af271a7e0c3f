"""The shard data plane through one hop against raw aioquic, measured in the same run.

    python bench/dataplane.py [--hidden 2048] [--blocks 15] [--block-steps 200] [--chunks 8] [--transfers 5]

A child process serves two things on loopback: a raw aioquic echo server
(``aioquic.asyncio.serve``, nothing of meshnode on the wire path) and a meshnode
node edge — QUIC transport, dispatcher and :class:`ShardServer` — over a
zero-compute engine that serves the tail range ``[1, 2)`` of a two-layer model
(it takes hidden states, samples token 0, keeps only each session's length).
This process is the caller:

- decode round trip: :meth:`ShardSession.decode` of one ``[1, hidden]`` float32
  hidden state (a DecodeStep; the answer is a token chunk, an Ack and a credit
  grant) against a raw round trip of the same request and response sizes on
  one aioquic stream. Target: ≤ 1.5× raw.
- prefill throughput: :meth:`ShardSession.prefill` of ``chunks × 128`` tokens of
  hidden states (128-token ActivationChunks, credit-paced, each checksummed and
  validated by the worker) against raw aioquic bulk transfer of the same bytes
  on one stream. Target: ≥ 70% of raw.

Baseline and data plane alternate in short blocks (round trips) or single
transfers (bulk) over connections kept open, and each ratio is the median of the
per-block ratios, so load from other processes hits both alike. The meshnode
transport's own echo is printed too, to show how much of the gap is the transport.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import statistics
import subprocess
import sys
import time

import numpy as np
from aioquic.asyncio import QuicConnectionProtocol, connect, serve
from aioquic.quic.configuration import QuicConfiguration

from engines.interface import (
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineFingerprint,
    EngineHealth,
    EngineMetrics,
    LoadRequest,
    SessionKey,
    ShardEngine,
    StepRequest,
    StepResult,
)
from meshnode.dataplane import responses
from meshnode.dataplane.edges.server import ShardServer
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.payload import encode_hidden, encode_token_result
from meshnode.identity import NodeIdentity
from meshnode.mesh.dispatcher import CallerLinkHandler, Dispatcher, DispatchingLinkHandler
from meshnode.transport.base import PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicEndpoint
from meshnode.transport.quic_connection import self_signed_certificate
from meshnode.wire.framing import StreamType, encode_frame
from meshnode.wire.pb import shard

SERVER_SEED = bytes(range(32))
CHUNK_TOKENS = 128
CHUNK_BLOCK = 1 << 20
# The bench child serves a plain echo on this stream type, next to the data plane.
ECHO_STREAM = StreamType.SUBPROTOCOL
VOCAB = 256


class NullEngine(ShardEngine):
    """Zero compute: the tail of a two-layer model that samples token 0 and tracks session lengths."""

    def __init__(self, hidden: int) -> None:
        self._hidden = hidden
        self._past: dict[SessionKey, int] = {}
        self._caps = EngineCapabilities(
            fingerprint=EngineFingerprint("bench-null-model", "bench-null-recipe", "bench-null"),
            model_name="null",
            architecture="null",
            total_layers=2,
            layer_start=1,
            layer_end=2,
            hidden_size=hidden,
            vocab_size=VOCAB,
            max_sessions=16,
            max_context_tokens=1 << 24,
            backend="none",
            device="cpu",
        )

    def load(self, request: LoadRequest) -> EngineCapabilities:
        return self._caps

    def capabilities(self) -> EngineCapabilities:
        return self._caps

    def _step(self, request: StepRequest) -> StepResult:
        past = self._past.get(request.session, 0)
        if request.first_position and past != request.first_position:
            raise EngineError(EngineErrorKind.CACHE_MISS, "cache miss", actual_past_len=past)
        self._past[request.session] = end = request.first_position + request.n_tokens
        logits = np.zeros(VOCAB, dtype=np.float32) if request.want_logits else None
        token = 0 if request.sampling is not None else None
        return StepResult(past_len=end, cache_hit=past > 0, token_id=token, logits=logits)

    prefill = decode = _step

    def cancel(self, session: SessionKey) -> int:
        return 0

    def release(self, session: SessionKey) -> bool:
        return self._past.pop(session, None) is not None

    def health(self) -> EngineHealth:
        return EngineHealth(True, len(self._past), sum(self._past.values()), 1 << 24, 0)

    def metrics(self) -> EngineMetrics:
        return EngineMetrics()


FINGERPRINT = shard.Fingerprint(
    model_artifact_digest="bench-null-model",
    runtime_recipe_digest="bench-null-recipe",
    recipe_id="bench-null",
)
TAIL_RANGE = shard.ShardRange(start_layer=1, end_layer=2, effective_start_layer=1)


def raw_configuration(is_client: bool) -> QuicConfiguration:
    identity = NodeIdentity.from_seed(SERVER_SEED)
    config = QuicConfiguration(is_client=is_client, alpn_protocols=["bench/1"])
    if is_client:
        config.verify_mode = ssl.CERT_NONE
    else:
        config.certificate = self_signed_certificate(identity)
        config.private_key = identity.private_key
    return config


# ---------------------------------------------------------------------------- child: the servers


async def raw_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Frames ``[4 len][4 reply_len][payload]``; answers each with ``reply_len`` bytes."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            header = await reader.readexactly(8)
            length = int.from_bytes(header[:4], "little")
            reply = int.from_bytes(header[4:], "little")
            await reader.readexactly(length)
            if reply:
                writer.write(b"r" * reply)


async def transport_echo(framed: FramedStream) -> None:
    """The same echo on meshnode's own transport (frames ``[4 reply_len][payload]``), for attribution."""
    while (body := await framed.recv_frame()) is not None:
        reply = int.from_bytes(body[:4], "little")
        if reply:
            await framed.send_frame(b"r" * (reply - 4))


async def child(hidden: int) -> None:
    raw = await serve(
        "127.0.0.1",
        0,
        configuration=raw_configuration(False),
        stream_handler=lambda r, w: asyncio.ensure_future(raw_echo(r, w)),
    )
    assert raw._transport is not None
    raw_port = raw._transport.get_extra_info("sockname")[1]
    dispatcher = Dispatcher(is_admitted=lambda _peer: True)
    endpoint = await QuicEndpoint.listen(
        NodeIdentity.from_seed(SERVER_SEED), DispatchingLinkHandler(dispatcher), "127.0.0.1", 0
    )

    async def no_next_hop(node_id: bytes) -> PeerLink:
        raise ConnectionError("the bench has one hop")

    server = ShardServer(NullEngine(hidden), links=no_next_hop)
    await server.start()
    server.register(dispatcher.register)
    dispatcher.register(ECHO_STREAM, transport_echo)
    print(f"ready {raw_port} {endpoint.local_address[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


# ---------------------------------------------------------------------------- parent: the measurements


def frame_sizes(hidden: int) -> tuple[int, int]:
    """Bytes on the wire for one decode step and its answer (frames, no transport overhead)."""
    tensor = encode_hidden(np.ones((1, hidden), np.float32), shard.DTYPE_FLOAT32, shard.COMPRESSION_NONE)
    work_id = "0123456789abcdef0123456789abcdef/1/1000"
    request = shard.SessionRequest(
        decode=shard.DecodeStep(
            idempotency_step=1000,
            position=1000,
            expected_past_len=1000,
            tensor=tensor,
            work_id=work_id,
            deadline_unix_nanos=time.time_ns(),
        )
    )
    chunk = responses.result_chunk(
        work_id=work_id,
        session_id=work_id[:32],
        epoch=1,
        step=1000,
        decode=True,
        first_position=1000,
        token_count=1,
        bundle=encode_token_result(7, None),
    )
    ack = responses.ack(work_id, 1000, shard.CacheResult(past_len=1001), duplicate=False, execution_nanos=1)
    answer = sum(len(encode_frame(m.SerializeToString())) for m in (chunk, ack))
    return len(encode_frame(request.SerializeToString())), answer


class Raw:
    """One aioquic connection to the child's raw echo server."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def __aenter__(self) -> Raw:
        self._context = connect("127.0.0.1", self.port, configuration=raw_configuration(True))
        self.client: QuicConnectionProtocol = await self._context.__aenter__()
        self.reader, self.writer = await self.client.create_stream()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._context.__aexit__(*exc)

    async def round_trips(self, request_bytes: int, reply_bytes: int, count: int) -> float:
        payload = b"q" * (request_bytes - 8)
        message = len(payload).to_bytes(4, "little") + reply_bytes.to_bytes(4, "little") + payload
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.writer.write(message)
            await self.reader.readexactly(reply_bytes)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    async def bulk(self, nbytes: int) -> float:
        """Bytes/s for ``nbytes`` on a fresh stream, until the receiver's 8-byte answer."""
        reader, writer = await self.client.create_stream()
        block = b"b" * CHUNK_BLOCK
        start = time.perf_counter()
        writer.write(nbytes.to_bytes(4, "little") + (8).to_bytes(4, "little"))
        sent = 0
        while sent < nbytes:
            take = min(len(block), nbytes - sent)
            writer.write(block[:take])
            sent += take
            await asyncio.sleep(0)  # aioquic buffers without bound: let it drain as it goes
        await reader.readexactly(8)
        return nbytes / (time.perf_counter() - start)


async def transport_round_trips(link: PeerLink, request_bytes: int, reply_bytes: int, count: int) -> float:
    stream = await link.open_stream(ECHO_STREAM)
    body = reply_bytes.to_bytes(4, "little") + b"q" * (request_bytes - 8)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await stream.send_frame(body)
        await stream.recv_frame()
        times.append(time.perf_counter() - start)
    stream.finish()
    return statistics.median(times)


async def mesh_link(port: int) -> tuple[QuicEndpoint, PeerLink]:
    endpoint = await QuicEndpoint.listen(NodeIdentity.generate(), CallerLinkHandler(), "127.0.0.1", 0)
    link = await endpoint.dial(f"127.0.0.1:{port}", NodeIdentity.from_seed(SERVER_SEED).node_id)
    return endpoint, link


class Decoder:
    """A data-plane session kept open across blocks, stepping through positions."""

    def __init__(self, session: ShardSession, hidden: int) -> None:
        self.session = session
        self.state = np.ones((1, hidden), np.float32)
        self.position = 0

    async def round_trips(self, count: int) -> float:
        if self.position == 0:
            await self.session.prefill(self.state)
            self.position = 1
        times = []
        for _ in range(count):
            start = time.perf_counter()
            await self.session.decode(
                self.state, position=self.position, deadline_unix_ns=time.time_ns() + 10**10
            )
            times.append(time.perf_counter() - start)
            self.position += 1
        return statistics.median(times)


async def mesh_prefill(link: PeerLink, hidden: int, chunks: int) -> float:
    states = np.ones((chunks * CHUNK_TOKENS, hidden), np.float32)
    async with ShardSession.open(link, fingerprint=FINGERPRINT, shard_range=TAIL_RANGE) as session:
        start = time.perf_counter()
        result = await session.prefill(states)
        elapsed = time.perf_counter() - start
        assert len(result.chunks) == chunks and result.token == 0
        return states.nbytes / elapsed


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


async def parent(args: argparse.Namespace) -> None:
    process = subprocess.Popen(
        [sys.executable, __file__, "--child", "--hidden", str(args.hidden)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    request_bytes, reply_bytes = frame_sizes(args.hidden)
    bulk_bytes = args.chunks * CHUNK_TOKENS * args.hidden * 4
    series: dict[str, list[float]] = {
        k: [] for k in ("raw_rtt", "transport_rtt", "mesh_rtt", "raw_bulk", "mesh_bulk")
    }
    try:
        assert process.stdout is not None
        _, raw_port, mesh_port = process.stdout.readline().split()
        endpoint, link = await mesh_link(int(mesh_port))
        async with (
            Raw(int(raw_port)) as raw,
            ShardSession.open(link, fingerprint=FINGERPRINT, shard_range=TAIL_RANGE) as session,
        ):
            decoder = Decoder(session, args.hidden)
            # Warm up every path, then alternate short blocks so that load from other
            # processes on the machine hits baseline and data plane alike.
            await raw.round_trips(request_bytes, reply_bytes, 200)
            await transport_round_trips(link, request_bytes, reply_bytes, 200)
            await decoder.round_trips(200)
            for _ in range(args.blocks):
                series["raw_rtt"].append(await raw.round_trips(request_bytes, reply_bytes, args.block_steps))
                series["mesh_rtt"].append(await decoder.round_trips(args.block_steps))
                series["transport_rtt"].append(
                    await transport_round_trips(link, request_bytes, reply_bytes, args.block_steps)
                )
            await raw.bulk(bulk_bytes)
            await mesh_prefill(link, args.hidden, args.chunks)
            for _ in range(args.transfers):
                series["raw_bulk"].append(await raw.bulk(bulk_bytes))
                series["mesh_bulk"].append(await mesh_prefill(link, args.hidden, args.chunks))
        endpoint.close()
    finally:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(10)

    def med(key: str) -> float:
        return statistics.median(series[key])

    rtt_ratio = median_ratio(series["mesh_rtt"], series["raw_rtt"])
    transport_ratio = median_ratio(series["transport_rtt"], series["raw_rtt"])
    bulk_ratio = median_ratio(series["mesh_bulk"], series["raw_bulk"])
    print(
        f"hidden {args.hidden}: decode request {request_bytes} B, answer {reply_bytes} B; "
        f"{args.blocks} blocks of {args.block_steps} round trips; {args.transfers} transfers of "
        f"{bulk_bytes / 2**20:.1f} MiB ({args.chunks} chunks of {CHUNK_TOKENS} tokens)"
    )
    print(
        f"decode round trip   raw aioquic {med('raw_rtt') * 1e6:6.0f} µs   data plane {med('mesh_rtt') * 1e6:6.0f} µs"
        f"   ratio {rtt_ratio:.2f}×  (target ≤ 1.5×)"
    )
    print(
        f"  (meshnode transport echo alone {med('transport_rtt') * 1e6:6.0f} µs, {transport_ratio:.2f}× raw)"
    )
    print(
        f"prefill throughput  raw aioquic {med('raw_bulk') * 8 / 1e6:6.1f} Mbit/s   data plane "
        f"{med('mesh_bulk') * 8 / 1e6:6.1f} Mbit/s   ratio {bulk_ratio:.2f}  (target ≥ 0.70)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (2048)")
    parser.add_argument("--blocks", type=int, default=15, help="alternating blocks of round trips (15)")
    parser.add_argument("--block-steps", type=int, default=200, help="round trips per block (200)")
    parser.add_argument("--chunks", type=int, default=8, help="prefill chunks per transfer (8)")
    parser.add_argument("--transfers", type=int, default=5, help="alternating transfers (5)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(child(args.hidden) if args.child else parent(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
