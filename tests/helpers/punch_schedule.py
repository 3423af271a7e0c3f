"""What a pair's punch schedule allows, counted on a clock the caller moves (shared by the unit
tests of the schedule and the NAT lab's test of a pair that cannot punch)."""

from __future__ import annotations

from meshnode.traversal.pair_backoff import PairBackoff, PunchSchedule


def most_attempts(schedule: PunchSchedule, seconds: float, step_s: float = 0.05) -> int:
    """The most attempts ``schedule`` allows a pair in ``seconds`` of failures, each taking no time."""
    pair, now, count = PairBackoff(schedule), 0.0, 0
    while now <= seconds:
        if pair.may_try(now):
            pair.attempted(now, succeeded=False)
            count += 1
        now += step_s
    return count
