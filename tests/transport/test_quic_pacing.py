"""Pacing against a clock that moves in whole milliseconds.

The event loop's time (uvloop: libuv's millisecond clock) and timers move in ticks of
about a millisecond, so a pacer can only refill once per tick. These pin what a sender
gets per tick from :class:`LoopClockPacer`, with time driven by hand.
"""

from __future__ import annotations

from meshnode.identity import NodeIdentity
from meshnode.transport.quic_connection import (
    LOOP_CLOCK_TICK_S,
    LoopClockPacer,
    MeshQuicConnection,
    quic_configuration,
    self_signed_certificate,
)

DATAGRAM = 1200


def packets_per_tick(pacer: LoopClockPacer, ticks: int) -> list[int]:
    """Send whenever the pacer allows, with ``now`` advancing one tick at a time."""
    sent = []
    now = 1000.0
    for _ in range(ticks):
        now += LOOP_CLOCK_TICK_S
        count = 0
        while pacer.next_send_time(now) is None and count < 100_000:
            pacer.update_after_send(now)
            count += 1
        sent.append(count)
    return sent


def test_a_large_window_on_a_short_path_is_not_throttled_to_a_few_packets_per_tick():
    # A 4 MB window over a 1 ms RTT is 4 GB/s.
    # aioquic's own bucket (16 packets, fewer at this rate) held such a sender to a
    # handful of datagrams per tick: a prefill at a third of its speed.
    pacer = LoopClockPacer(max_datagram_size=DATAGRAM)
    pacer.update_rate(congestion_window=4_000_000, smoothed_rtt=0.001)
    per_tick = packets_per_tick(pacer, ticks=5)
    rate_per_tick = 4_000_000 / 0.001 * LOOP_CLOCK_TICK_S / DATAGRAM
    # aioquic's per-packet time never drops below 1 µs: at most 1 000 datagrams per
    # tick (1.2 GB/s), far beyond what a Python sender reaches.
    expected = min(rate_per_tick, LOOP_CLOCK_TICK_S / 1e-6)
    assert min(per_tick[1:]) >= 0.9 * expected, per_tick


def test_a_modest_rate_is_still_paced_to_about_one_tick_of_it():
    # 120 KB per 10 ms is 12 MB/s: ten datagrams per tick, not the whole window at once.
    pacer = LoopClockPacer(max_datagram_size=DATAGRAM)
    pacer.update_rate(congestion_window=120_000, smoothed_rtt=0.010)
    per_tick = packets_per_tick(pacer, ticks=5)
    rate_per_tick = 120_000 / 0.010 * LOOP_CLOCK_TICK_S / DATAGRAM
    assert all(count <= 2 * rate_per_tick + 1 for count in per_tick), per_tick
    assert sum(per_tick[1:]) >= 0.9 * rate_per_tick * len(per_tick[1:]), per_tick


def test_meshnode_connections_pace_with_it():
    identity = NodeIdentity.generate()
    configuration = quic_configuration(
        identity,
        self_signed_certificate(identity),
        is_client=True,
        stream_window=1 << 20,
        connection_window=4 << 20,
        idle_timeout=30.0,
        max_datagram_size=DATAGRAM,
    )
    connection = MeshQuicConnection(
        stream_window=1 << 20, connection_window=4 << 20, configuration=configuration
    )
    # aioquic has no public view of the pacer its loss recovery paces with; MeshQuicConnection sets it.
    assert isinstance(connection._loss._pacer, LoopClockPacer)
