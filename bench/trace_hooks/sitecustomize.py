"""Timestamps along a decode step's path, for bench/hop_timeline.py (never loaded by the product).

A node process started with this directory on PYTHONPATH and MESHNODE_TRACE_DIR set records
``(perf_counter_ns, event, detail)`` at: every UDP datagram in and out (QuicEndpoint), every
frame a shard worker receives, the engine thread's start and end of each batch, and the loop
taking the batch's result back. perf_counter_ns is CLOCK_MONOTONIC, one clock for every process
on the machine, so the files of all nodes merge into one timeline. A daemon thread appends the
events to ``<dir>/<pid>.trace`` every half second.
"""

from __future__ import annotations

import os
import threading
import time

_DIR = os.environ.get("MESHNODE_TRACE_DIR")


def _install(directory: str) -> None:
    from meshnode.dataplane.actions import RunBatch
    from meshnode.dataplane.edges import server as shard_server
    from meshnode.dataplane.worker import ShardWorker
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

    QuicEndpoint.datagram_received = traced_received  # type: ignore[method-assign]  # wrapped in place
    QuicEndpoint.sendto = traced_sendto  # type: ignore[method-assign]  # wrapped in place
    ShardWorker.receive_frame = traced_frame  # type: ignore[method-assign]  # wrapped in place
    RunBatch.execute = traced_execute  # type: ignore[method-assign]  # wrapped in place
    shard_server.ShardServer._batch_done = traced_done  # type: ignore[method-assign]  # wrapped in place


if _DIR:
    _install(_DIR)
