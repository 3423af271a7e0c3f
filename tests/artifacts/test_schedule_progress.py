"""The fetch plan's rules, the upload bucket and the progress record: pure, time as a parameter."""

from __future__ import annotations

import io

from meshnode.artifacts.progress import ProgressDisplay, TransferProgress
from meshnode.artifacts.schedule import FetchPlan, Quarantine
from meshnode.artifacts.upload_limit import ByteBucket, UploadLimiter
from meshnode.sansio import SECOND_NS

A, B = b"a" * 32, b"b" * 32


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
    progress.begin(total_bytes=10_000, resumed_bytes=2_000, now_ns=0)
    assert progress.eta_s(0) is None
    progress.advance(4_000, 2 * SECOND_NS)
    assert progress.rate(2 * SECOND_NS) == 2_000
    assert progress.eta_s(2 * SECOND_NS) == 2.0
    status = progress.as_status(2 * SECOND_NS)
    assert status["done_bytes"] == 6_000 and status["total_bytes"] == 10_000
    assert status["resumed_bytes"] == 2_000 and status["fraction"] == 0.6
    assert status["eta_s"] == 2.0 and status["finished"] is False


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
