"""When a pair of nodes may try to punch again (pure; the clock is a parameter).

A round is up to ``attempts_per_round`` attempts, ``retry_gap_s`` apart; a round that fails
waits ``first_backoff_s``, doubling with every failed round up to ``max_backoff_s``. A direct
path that dies counts as a failed round, unless it had held for ``stable_s``: a pair whose
path keeps dying waits longer each time, so it never flaps between direct and relayed faster
than its backoff. Both sides keep the same schedule: the initiator to know when to ask, the
responder to decline a peer that asks sooner (allowing ``answer_slack_s`` for the clocks' and
the round trip's difference), so no member can make another send punches faster than this.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PunchSchedule:
    attempts_per_round: int = 3
    retry_gap_s: float = 1.0
    first_backoff_s: float = 60.0
    max_backoff_s: float = 1800.0
    # A direct path that lived this long resets the pair's failures when it dies.
    stable_s: float = 600.0
    answer_slack_s: float = 5.0
    # Attempts running at once, and started in any minute, with all peers together.
    max_running: int = 4
    max_per_minute: int = 30

    def backoff_after(self, failed_rounds: int) -> float:
        if failed_rounds <= 0:
            return 0.0
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (failed_rounds - 1))


class PairBackoff:
    """One peer's punch schedule, as seen from this node."""

    def __init__(self, schedule: PunchSchedule) -> None:
        self.schedule = schedule
        self.attempts = 0  # in the current round
        self.failed_rounds = 0
        self.next_at = float("-inf")

    def may_try(self, now: float) -> bool:
        return now >= self.next_at

    def may_answer(self, now: float) -> bool:
        return now >= self.next_at - self.schedule.answer_slack_s

    def retry_in(self, now: float) -> float:
        return max(0.0, self.next_at - now)

    def attempted(self, now: float, *, succeeded: bool) -> None:
        if succeeded:
            # Failures are forgotten only once the path has held (path_lost decides).
            self.attempts = 0
            self.next_at = now
            return
        self.attempts += 1
        if self.attempts < self.schedule.attempts_per_round:
            self.next_at = now + self.schedule.retry_gap_s
            return
        self._round_failed(now)

    def give_up_round(self, now: float) -> None:
        """The peer cannot take part (punching off, a symmetric NAT): no more tries this round."""
        self._round_failed(now)

    def wait_at_least(self, now: float, seconds: float) -> None:
        """The peer asked to be left alone this long (it is backing off, or busy)."""
        self.next_at = max(self.next_at, now + seconds)

    def path_lost(self, now: float, *, lived_s: float) -> None:
        if lived_s >= self.schedule.stable_s:
            self.failed_rounds = 0
        self._round_failed(now)

    def _round_failed(self, now: float) -> None:
        self.attempts = 0
        self.failed_rounds += 1
        self.next_at = now + self.schedule.backoff_after(self.failed_rounds)


class PunchBook:
    """Every pair's schedule, and the limits on all attempts together. Bounded: at most
    ``max_pairs`` peers are remembered, those not backing off forgotten first."""

    def __init__(self, schedule: PunchSchedule | None = None, *, max_pairs: int = 1024) -> None:
        self.schedule = schedule or PunchSchedule()
        self._pairs: OrderedDict[bytes, PairBackoff] = OrderedDict()
        self._max_pairs = max_pairs
        self._running: set[bytes] = set()
        self._started: deque[float] = deque()

    def pair(self, peer_id: bytes, now: float) -> PairBackoff | None:
        """The peer's schedule (made on first use); ``None`` when the book is full of pairs that
        are all backing off."""
        backoff = self._pairs.get(peer_id)
        if backoff is not None:
            self._pairs.move_to_end(peer_id)
            return backoff
        if len(self._pairs) >= self._max_pairs:
            idle = next(
                (p for p, b in self._pairs.items() if b.may_try(now) and p not in self._running), None
            )
            if idle is None:
                return None
            del self._pairs[idle]
        backoff = self._pairs[peer_id] = PairBackoff(self.schedule)
        return backoff

    def known(self, peer_id: bytes) -> PairBackoff | None:
        return self._pairs.get(peer_id)

    def room_to_start(self, now: float) -> bool:
        """Whether another attempt may start now (running ones and the minute's count allow)."""
        while self._started and self._started[0] <= now - 60.0:
            self._started.popleft()
        return (
            len(self._running) < self.schedule.max_running
            and len(self._started) < self.schedule.max_per_minute
        )

    def running(self, peer_id: bytes) -> bool:
        return peer_id in self._running

    def start(self, peer_id: bytes, now: float) -> None:
        self._running.add(peer_id)
        self._started.append(now)

    def finish(self, peer_id: bytes) -> None:
        self._running.discard(peer_id)


__all__ = ["PairBackoff", "PunchBook", "PunchSchedule"]
