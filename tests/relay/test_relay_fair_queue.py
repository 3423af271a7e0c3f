"""Deficit round robin across senders, and the token buckets."""

from __future__ import annotations

from meshnode.relaywire.ratelimit import TokenBucket
from relay.fair_queue import FairQueue


def drain(queue: FairQueue) -> list[tuple[bytes, bytes]]:
    out = []
    while (item := queue.pop()) is not None:
        out.append(item)
    return out


def test_empty_queue_pops_none() -> None:
    assert FairQueue(100).pop() is None


def test_equal_frames_alternate_between_sources() -> None:
    queue = FairQueue(2)  # one 2-byte frame per turn
    for i in range(3):
        queue.push(b"a", b"a%d" % i)
        queue.push(b"b", b"b%d" % i)
    assert [frame for _, frame in drain(queue)] == [b"a0", b"b0", b"a1", b"b1", b"a2", b"b2"]
    assert queue.nbytes == 0 and len(queue) == 0


def test_service_is_fair_by_bytes_not_frames() -> None:
    queue = FairQueue(1000)
    for _ in range(10):
        queue.push(b"big", b"B" * 1000)
    for _ in range(100):
        queue.push(b"small", b"s" * 100)
    served = {b"big": 0, b"small": 0}
    for _ in range(40):
        source, frame = queue.pop()
        served[source] += len(frame)
    # Both got about the same number of bytes, one quantum per turn.
    assert abs(served[b"big"] - served[b"small"]) <= 1000


def test_frame_larger_than_the_quantum_is_served_after_enough_turns() -> None:
    queue = FairQueue(100, frame_overhead=10)
    queue.push(b"a", b"x" * 450)
    queue.push(b"b", b"y" * 50)
    queue.push(b"b", b"y" * 50)
    order = [source for source, _ in drain(queue)]
    assert order == [b"b", b"b", b"a"]


def test_overhead_counts_in_bytes_and_drop_source_frees_them() -> None:
    queue = FairQueue(100, frame_overhead=64)
    queue.push(b"a", b"")
    queue.push(b"a", b"12")
    queue.push(b"b", b"3")
    assert queue.nbytes == 64 * 3 + 3
    assert queue.source_bytes(b"a") == 128 + 2
    assert queue.drop_source(b"a") == 130
    assert queue.nbytes == 65 and len(queue) == 1 and queue.active_sources == 1
    assert drain(queue) == [(b"b", b"3")]


def test_token_bucket_debt_and_refill() -> None:
    ms = 1_000_000
    bucket = TokenBucket.full(rate=100, burst=50, now_ns=0)
    assert bucket.charge(30, now_ns=0) == 0
    assert bucket.charge(40, now_ns=0) == 200 * ms  # 20 in debt at 100/s
    assert bucket.debt_delay_ns(now_ns=100 * ms) == 100 * ms
    assert bucket.debt_delay_ns(now_ns=200 * ms) == 0
    assert bucket.delay_for_ns(50, now_ns=200 * ms) == 500 * ms
    assert bucket.delay_for_ns(10_000, now_ns=700 * ms) == 0  # capped at the burst: a full bucket is enough


def test_token_bucket_delays_round_up_so_waiting_them_out_suffices() -> None:
    bucket = TokenBucket.full(rate=3, burst=1, now_ns=0)
    delay = bucket.charge(2, now_ns=0)  # one token in debt at 3/s: a third of a second
    assert delay == 333_333_334
    assert bucket.debt_delay_ns(now_ns=delay - 1) > 0
    assert bucket.debt_delay_ns(now_ns=delay) == 0


def test_unlimited_bucket_never_delays() -> None:
    bucket = TokenBucket.full(rate=0, burst=0, now_ns=0)
    assert bucket.charge(1e12, now_ns=0) == 0
    assert bucket.delay_for_ns(1e12, now_ns=0) == 0
