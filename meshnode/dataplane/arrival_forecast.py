"""When each session's next unit is due at this shard, so the engine can wait briefly for it.

Continuous batching alone does not bring sessions that fell out of step back together.
Two sessions on one node: A's batch runs while B's step arrives; when A's batch ends,
only B is ready, so B runs alone while A's next step comes back; and so on for ever,
every batch holding one session and each session waiting a whole batch for the other
(measured: two streams on one node got 0.94x the tokens/s of one). The same happens
between stages: a batch's results travel on as one message per session, and the next
stage would start on the first to arrive.

Two predictions, per session still awaited (its result left, its next unit not in):

- its rhythm: the head sends a session's next step as soon as it has the previous
  token, so the gap from a result leaving this shard to the next unit arriving is
  regular; it is learnt per session (smoothed);
- its cohort: sessions whose results left in the same batch travel the same way and
  come back together, so once one of them is in, the others are due at once.

When the engine is free, the worker asks which awaited sessions are due within a
horizon it chooses (about one batch) and waits until they are in or their slack has
passed, never past the horizon and never for one already late, so a session that went
quiet costs at most one such wait. Pure bookkeeping on the ``now_ns`` it is given.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# How much of a new gap the smoothed one takes.
_SMOOTHING = 0.5
# Slack on a predicted arrival: jitter of the round trip, as a share of the gap plus a floor.
_SLACK_SHARE = 0.5
_SLACK_FLOOR_NS = 500_000
# How long after the first of a cohort the rest are still worth waiting for: the results of
# one batch reach the next stage within a few hundred microseconds of each other.
_COHORT_SLACK_NS = 2_000_000


@dataclass(slots=True)
class _Rhythm:
    # When its last result left, while its next unit has not arrived (None: nothing expected).
    answered_ns: int | None = None
    # Smoothed time from a result leaving to the next unit arriving (None: not measured yet).
    gap_ns: float | None = None

    def by_rhythm(self) -> tuple[int, int] | None:
        """When its next unit should arrive, and the latest it is still worth waiting for."""
        if self.answered_ns is None or self.gap_ns is None:
            return None
        predicted = self.answered_ns + round(self.gap_ns)
        return predicted, predicted + round(max(self.gap_ns * _SLACK_SHARE, _SLACK_FLOOR_NS))


class ArrivalForecast:
    """Per session: when its last result left and how long its next unit usually takes."""

    def __init__(self) -> None:
        self._rhythms: dict[str, _Rhythm] = {}
        # A cohort (the time its results left) -> when its first member came back.
        self._cohort_back: dict[int, int] = {}

    def answered(self, session_id: str, now_ns: int) -> None:
        """A result of ``session_id`` left this shard and it has nothing else queued: its next
        unit is expected. Results leaving at the same ``now_ns`` form a cohort."""
        self._rhythms.setdefault(session_id, _Rhythm()).answered_ns = now_ns

    def arrived(self, session_id: str, now_ns: int) -> None:
        """A unit of ``session_id`` arrived: learn the gap since its last result, if one was awaited."""
        rhythm = self._rhythms.setdefault(session_id, _Rhythm())
        left = rhythm.answered_ns
        if left is not None:
            gap = max(0, now_ns - left)
            rhythm.gap_ns = (
                gap if rhythm.gap_ns is None else rhythm.gap_ns + _SMOOTHING * (gap - rhythm.gap_ns)
            )
            self._cohort_back.setdefault(left, now_ns)
        rhythm.answered_ns = None
        self._prune_cohorts()

    def forget(self, session_id: str) -> None:
        self._rhythms.pop(session_id, None)
        self._prune_cohorts()

    def __len__(self) -> int:
        return len(self._rhythms)

    def due_within(self, ready: Collection[str], now_ns: int, horizon_ns: int) -> int | None:
        """How long to wait for the awaited sessions outside ``ready`` that should arrive within
        ``horizon_ns`` and are not past their slack yet: until the latest one's slack ends, but
        never past the horizon. None when there is none to wait for."""
        if horizon_ns <= 0:
            return None
        latest: int | None = None
        for session_id, rhythm in self._rhythms.items():
            if session_id in ready or rhythm.answered_ns is None:
                continue
            for predicted, give_up in self._predictions(rhythm):
                if predicted <= now_ns + horizon_ns and now_ns < give_up:
                    latest = give_up if latest is None else max(latest, give_up)
        return None if latest is None else min(latest, now_ns + horizon_ns)

    def _predictions(self, rhythm: _Rhythm) -> list[tuple[int, int]]:
        out = []
        by_rhythm = rhythm.by_rhythm()
        if by_rhythm is not None:
            out.append(by_rhythm)
        assert rhythm.answered_ns is not None
        back = self._cohort_back.get(rhythm.answered_ns)
        if back is not None:
            out.append((back, back + _COHORT_SLACK_NS))
        return out

    def _prune_cohorts(self) -> None:
        """Keep only the cohorts some awaited session still belongs to (at most one per session)."""
        awaited = {r.answered_ns for r in self._rhythms.values() if r.answered_ns is not None}
        for left in [left for left in self._cohort_back if left not in awaited]:
            del self._cohort_back[left]


__all__ = ["ArrivalForecast"]
