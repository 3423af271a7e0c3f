"""When a pair may punch again (pure, on a clock the test moves)."""

from __future__ import annotations

from helpers.punch_schedule import most_attempts

from meshnode.traversal.pair_backoff import PairBackoff, PunchBook, PunchSchedule

SCHEDULE = PunchSchedule(attempts_per_round=3, retry_gap_s=1.0, first_backoff_s=60.0, max_backoff_s=240.0)
PEER = b"\x02" * 32


def fail_round(pair: PairBackoff, now: float) -> float:
    """Three failed attempts as soon as each is allowed; the time of the last."""
    for _ in range(SCHEDULE.attempts_per_round):
        now = max(now, pair.next_at)
        assert pair.may_try(now)
        pair.attempted(now, succeeded=False)
    return now


def test_three_attempts_a_round_then_a_backoff_that_doubles_up_to_its_cap():
    pair = PairBackoff(SCHEDULE)
    end = fail_round(pair, 0.0)
    assert end == 2.0 and pair.retry_in(end) == 60.0 and not pair.may_try(end + 59.9)
    end = fail_round(pair, end + 60.0)
    assert pair.retry_in(end) == 120.0
    end = fail_round(pair, end + 120.0)
    assert pair.retry_in(end) == 240.0
    end = fail_round(pair, end + 240.0)
    assert pair.retry_in(end) == 240.0  # capped


def test_over_two_minutes_of_failures_a_pair_makes_at_most_six_attempts():
    assert most_attempts(PunchSchedule(), 120.0) == 6


def test_a_path_that_keeps_dying_waits_longer_each_time_one_that_held_starts_over():
    pair = PairBackoff(SCHEDULE)
    pair.attempted(0.0, succeeded=True)
    assert pair.may_try(0.0)
    pair.path_lost(30.0, lived_s=30.0)
    assert pair.retry_in(30.0) == 60.0
    pair.attempted(90.0, succeeded=True)
    pair.path_lost(100.0, lived_s=10.0)
    assert pair.retry_in(100.0) == 120.0  # no flapping faster than the backoff
    pair.attempted(220.0, succeeded=True)
    pair.path_lost(2000.0, lived_s=1780.0)  # held past stable_s: failures forgotten
    assert pair.retry_in(2000.0) == 60.0


def test_the_responder_allows_its_slack_and_no_more():
    pair = PairBackoff(SCHEDULE)
    fail_round(pair, 0.0)
    assert not pair.may_answer(2.0 + 60.0 - SCHEDULE.answer_slack_s - 0.1)
    assert pair.may_answer(2.0 + 60.0 - SCHEDULE.answer_slack_s)


def test_the_book_caps_running_attempts_and_attempts_per_minute():
    book = PunchBook(PunchSchedule(max_running=2, max_per_minute=3))
    peers = [bytes([i]) * 32 for i in range(5)]
    book.start(peers[0], 0.0)
    book.start(peers[1], 0.0)
    assert book.running(peers[0]) and not book.room_to_start(0.0)
    book.finish(peers[0])
    assert book.room_to_start(1.0)
    book.start(peers[2], 1.0)
    book.finish(peers[1])
    book.finish(peers[2])
    assert not book.room_to_start(30.0)  # three started in the last minute
    assert book.room_to_start(60.5)


def test_the_book_forgets_idle_pairs_first_and_refuses_when_all_are_backing_off():
    book = PunchBook(SCHEDULE, max_pairs=2)
    first, second, third = (bytes([i]) * 32 for i in (1, 2, 3))
    fail_round(book.pair(first, 0.0), 0.0)  # backing off
    assert book.pair(second, 0.0) is not None  # idle
    assert book.pair(third, 3.0) is not None  # second forgotten
    assert book.known(second) is None and book.known(first) is not None
    fail_round(book.known(third), 3.0)
    assert book.pair(second, 10.0) is None  # both remembered pairs are backing off
