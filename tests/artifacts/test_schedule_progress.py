"""The fetch plan's rules, the upload bucket and the progress record: pure, time as a parameter."""

from __future__ import annotations

import io

import pytest

from meshnode.artifacts.progress import ETA_AFTER_NS, RATE_TIME_CONSTANT_NS, ProgressDisplay, TransferProgress
from meshnode.artifacts.schedule import FetchPlan, Quarantine
from meshnode.artifacts.upload_limit import ByteBucket, UploadLimiter
from meshnode.sansio import SECOND_NS

A, B = b"a" * 32, b"b" * 32
MIB = 1 << 20


def test_a_source_takes_only_tensors_it_holds_in_queue_order():
    plan = FetchPlan([0, 1, 2], {A: frozenset({1, 2}), B: frozenset({0, 1, 2})})
    assert plan.take(A) == 1
    assert plan.take(A) == 2
    assert plan.take(A) is None
    assert plan.take(B) == 0
    assert plan.take(B) is None
    assert not plan.finished


def test_a_failed_tensor_goes_back_to_the_front_for_another_source():
    plan = FetchPlan([0, 1], {A: frozenset({0, 1}), B: frozenset({0, 1})})
    assert plan.take(A) == 0
    assert plan.may_get_work(B)
    plan.give_back(0)
    plan.lose(A, "quarantined")
    assert plan.take(A) is None
    assert not plan.may_get_work(A)
    assert plan.take(B) == 0
    plan.succeeded(0, B)
    assert plan.take(B) == 1
    plan.succeeded(1, B)
    assert plan.finished
    assert plan.done == {0: B, 1: B}


def test_a_source_waits_only_for_in_flight_tensors_it_could_take_over():
    plan = FetchPlan([0], {A: frozenset({0}), B: frozenset({0}), b"c" * 32: frozenset()})
    assert plan.take(A) == 0
    assert plan.may_get_work(B)
    assert not plan.may_get_work(b"c" * 32)
    plan.give_back(0, not_held_by=A)
    assert plan.take(A) is None
    plan.lose(B, "gone")
    assert plan.unobtainable() == [0]


def test_quarantine_keeps_the_first_reason():
    quarantine = Quarantine()
    quarantine.add(A, "flipped byte")
    quarantine.add(A, "again")
    assert A in quarantine and B not in quarantine
    assert quarantine.peers == {A: "flipped byte"}


def test_the_upload_bucket_paces_to_its_rate():
    bucket = ByteBucket.full(rate=1000, burst=500, now_ns=0)
    assert bucket.charge(500, 0) == 0
    assert bucket.charge(1000, 0) == SECOND_NS  # 1000 bytes of debt at 1000 B/s
    assert bucket.charge(0, SECOND_NS) == 0
    assert ByteBucket.full(rate=0, burst=1, now_ns=0).charge(10**9, 0) == 0


def test_uploads_are_paced_only_while_the_node_is_busy():
    now = [0]
    busy = [False]
    limiter = UploadLimiter(1000, 500, clock_ns=lambda: now[0], is_busy=lambda: busy[0])
    assert limiter.delay_ns(10_000) == 0
    busy[0] = True
    assert limiter.delay_ns(500) == 0  # a full bucket to start from
    assert limiter.delay_ns(1000) == SECOND_NS


def test_progress_reports_rate_and_eta():
    progress = TransferProgress("tiny")
    progress.begin(total_bytes=100_000, resumed_bytes=20_000, now_ns=0)
    assert progress.eta_s(0) is None and progress.rate(0) == 0
    for second in range(1, 21):  # 2,000 bytes a second for 20 s
        progress.advance(2_000, second * SECOND_NS)
    now = 20 * SECOND_NS
    # Each second's bytes arrive at its end, so the newest weigh a little more: within 3%.
    assert progress.rate(now) == pytest.approx(2_000, rel=0.03)
    assert progress.eta_s(now) == pytest.approx(20.0, rel=0.03)
    status = progress.as_status(now)
    assert status["done_bytes"] == 60_000 and status["total_bytes"] == 100_000
    assert status["resumed_bytes"] == 20_000 and status["fraction"] == 0.6
    assert status["eta_s"] == pytest.approx(20.0, rel=0.03) and status["estimating"] is False
    assert status["finished"] is False


def test_no_eta_from_the_first_seconds_of_a_transfer():
    progress = TransferProgress("big")
    progress.begin(total_bytes=1000 * MIB, resumed_bytes=0, now_ns=0)
    # The first instants: a burst of 8 MiB in 10 ms (the old windowed rate: 800 MiB/s, an ETA of 1 s).
    progress.advance(8 * MIB, SECOND_NS // 100)
    assert progress.eta_s(SECOND_NS // 100) is None
    assert progress.as_status(SECOND_NS // 100)["estimating"] is True
    assert progress.line(SECOND_NS // 100).endswith("ETA estimating")
    # Then a steady 5 MiB/s: still no ETA until ETA_AFTER_NS.
    now = SECOND_NS // 100
    while now < ETA_AFTER_NS - SECOND_NS // 10:
        now += SECOND_NS // 10
        progress.advance(MIB // 2, now)
        assert progress.eta_s(now) is None, now
    # The early rate is the average since the start, not the burst's.
    assert progress.rate(now) < 6 * MIB
    now += SECOND_NS
    progress.advance(5 * MIB, now)
    assert progress.eta_s(now) is not None
    assert "estimating" not in progress.line(now)


def test_the_eta_follows_a_halved_rate_within_a_few_time_constants():
    """A second joiner starts sharing the source: 10 MiB/s for 15 s, then 5 MiB/s to the end."""
    total = 1500 * MIB
    progress = TransferProgress("shared")
    progress.begin(total_bytes=total, resumed_bytes=0, now_ns=0)
    step = SECOND_NS // 10
    now = 0
    while now < 15 * SECOND_NS:
        now += step
        progress.advance(MIB, now)
    first_eta = progress.eta_s(now)
    assert first_eta == pytest.approx((total - progress.done_bytes) / (10 * MIB), rel=0.01)
    while progress.done_bytes < total:
        now += step
        progress.advance(MIB // 2, now)
        eta = progress.eta_s(now)
        assert eta is not None
        truth = (total - progress.done_bytes) / (5 * MIB)
        if now - 15 * SECOND_NS >= 4 * RATE_TIME_CONSTANT_NS:
            assert eta == pytest.approx(truth, rel=0.05), now / SECOND_NS
    assert progress.eta_s(now) == 0.0


def test_a_stalled_transfer_shows_its_rate_falling_and_its_eta_growing():
    progress = TransferProgress("stalled")
    progress.begin(total_bytes=1000 * MIB, resumed_bytes=0, now_ns=0)
    for second in range(1, 31):
        progress.advance(4 * MIB, second * SECOND_NS)
    at_stall = progress.eta_s(30 * SECOND_NS)
    later = 30 * SECOND_NS + RATE_TIME_CONSTANT_NS
    assert progress.rate(later) < progress.rate(30 * SECOND_NS) / 2
    assert at_stall is not None and (progress.eta_s(later) or 0) > 2 * at_stall


def test_the_bar_is_drawn_only_on_a_terminal(caplog):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    progress = TransferProgress("tiny")
    progress.begin(100, 0, 0)
    progress.advance(50, SECOND_NS)
    terminal = Terminal()
    ProgressDisplay(progress, terminal).show(SECOND_NS)
    assert terminal.getvalue().startswith("\r[###############...............] tiny:")
    pipe = io.StringIO()
    with caplog.at_level("INFO", logger="meshnode.artifacts.progress"):
        ProgressDisplay(progress, pipe).show(SECOND_NS)
    assert pipe.getvalue() == ""
    assert "tiny: 0.0/0.0 MiB  50.0%" in caplog.text
