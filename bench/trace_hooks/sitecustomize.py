"""Timestamps along a decode step's path, for bench/hop_timeline.py (never loaded by the product).

A node process started with this directory on PYTHONPATH and MESHNODE_TRACE_DIR set records
``(perf_counter_ns, event, detail)`` at: every UDP datagram in and out (QuicEndpoint), every
frame a shard worker receives, the engine thread's start and end of each batch, and the loop
taking the batch's result back. perf_counter_ns is CLOCK_MONOTONIC, one clock for every process
on the machine, so the files of all nodes merge into one timeline. A daemon thread appends the
events to ``<dir>/<pid>.trace`` every half second.

For bench/token_timeline.py (one node, issue 54) also: the head's decode step entering and leaving
(``dec0``/``dec1``, :meth:`RouteDecoder.decode`), each answer frame its session client takes
(``ans``), each llama_decode call (``ll0``/``ll1``), each token sampled (``s0``/``s1``) and each
write of the API's event stream (``sse``).
"""

from __future__ import annotations

import os
import threading
import time

_DIR = os.environ.get("MESHNODE_TRACE_DIR")


def _install(directory: str) -> None:
    import llama_cpp
    from aiohttp import web

    from engines import sessioned_engine
    from meshnode.dataplane.actions import RunBatch
    from meshnode.dataplane.client import SessionClient
    from meshnode.dataplane.edges import server as shard_server
    from meshnode.dataplane.worker import ShardWorker
    from meshnode.head.route_decoding import RouteDecoder
    from meshnode.transport.quic import QuicEndpoint

    events: list[tuple[int, str, int]] = []
    record = events.append
    clock = time.perf_counter_ns
    path = os.path.join(directory, f"{os.getpid()}.trace")

    def flush() -> None:
        while True:
            time.sleep(0.5)
            taken = events[:]
            del events[: len(taken)]
            if taken:
                with open(path, "a") as out:
                    out.writelines(f"{t} {name} {detail}\n" for t, name, detail in taken)

    threading.Thread(target=flush, name="trace-flush", daemon=True).start()

    received = QuicEndpoint.datagram_received
    sendto = QuicEndpoint.sendto
    receive_frame = ShardWorker.receive_frame
    execute = RunBatch.execute
    batch_done = shard_server.ShardServer._batch_done
    decode = RouteDecoder.decode
    client_frame = SessionClient.receive_frame
    llama_decode = llama_cpp.llama_decode
    sample_token = sessioned_engine.sample_token
    sse_write = web.StreamResponse.write

    def traced_received(self, data, addr):
        record((clock(), "rx", len(data)))
        return received(self, data, addr)

    def traced_sendto(self, data, addr):
        record((clock(), "tx", len(data)))
        return sendto(self, data, addr)

    def traced_frame(self, stream_id, body, now_ns, *, unix_now_ns):
        record((clock(), "frame", len(body)))
        return receive_frame(self, stream_id, body, now_ns, unix_now_ns=unix_now_ns)

    def traced_execute(self, engine):
        record((clock(), "e0", len(self.steps)))
        try:
            return execute(self, engine)
        finally:
            record((clock(), "e1", len(self.steps)))

    def traced_done(self, batch_id, *rest):
        record((clock(), "back", batch_id))
        return batch_done(self, batch_id, *rest)

    async def traced_decode(self, route):
        record((clock(), "dec0", 0))
        try:
            return await decode(self, route)
        finally:
            record((clock(), "dec1", 0))

    def traced_client_frame(self, body):
        record((clock(), "ans", len(body)))
        return client_frame(self, body)

    def traced_llama_decode(ctx, batch):
        record((clock(), "ll0", 0))
        try:
            return llama_decode(ctx, batch)
        finally:
            record((clock(), "ll1", 0))

    def traced_sample(*args, **kwargs):
        record((clock(), "s0", 0))
        try:
            return sample_token(*args, **kwargs)
        finally:
            record((clock(), "s1", 0))

    async def traced_sse(self, data):
        record((clock(), "sse", len(data)))
        return await sse_write(self, data)

    RouteDecoder.decode = traced_decode  # type: ignore[method-assign]  # wrapped in place
    SessionClient.receive_frame = traced_client_frame  # type: ignore[method-assign]  # wrapped in place
    llama_cpp.llama_decode = traced_llama_decode
    sessioned_engine.sample_token = traced_sample
    web.StreamResponse.write = traced_sse  # type: ignore[method-assign]  # wrapped in place
    QuicEndpoint.datagram_received = traced_received  # type: ignore[method-assign]  # wrapped in place
    QuicEndpoint.sendto = traced_sendto  # type: ignore[method-assign]  # wrapped in place
    ShardWorker.receive_frame = traced_frame  # type: ignore[method-assign]  # wrapped in place
    RunBatch.execute = traced_execute  # type: ignore[method-assign]  # wrapped in place
    shard_server.ShardServer._batch_done = traced_done  # type: ignore[method-assign]  # wrapped in place


if _DIR:
    _install(_DIR)
