"""What a shard's engine batches came to, for ``/metrics``: sizes, busy time, queue waits.

The worker counts as it forms and finishes batches, on the ``now_ns`` it is given (so
the counts are as testable as the rest of it); :mod:`meshnode.metrics` reads them at
scrape time. Plain counters and fixed-bucket histograms, nothing that grows.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshnode.dataplane.stage_speed import StageSpeedMeter
from meshnode.sansio import SECOND_NS

# Units per batch: a bucket per doubling up to what one shard's sessions can make.
BATCH_SIZE_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)
# Seconds from a unit's arrival to the start of the batch that runs it.
QUEUE_WAIT_BOUNDS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# The trailing window the busy fraction covers: a property of the shard, so every scraper
# reads the same value (a share "since the previous scrape" would differ per scraper).
BUSY_WINDOW_NS = 10 * SECOND_NS
# Batches remembered for that window; a batch takes at least a millisecond or so, and when
# more end within the window the fraction undercounts rather than the memory growing.
_BUSY_INTERVALS_KEPT = 16_384


class Histogram:
    """Observations counted in fixed buckets (each an upper bound, the last one +Inf), with their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # counts[i]: observations <= bounds[i] and > bounds[i - 1]; the extra last one: above them all.
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at or below it)`` per bucket, ending with ``(inf, count)``."""
        running, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class BatchStats:
    batches: int = 0
    # Units that ran in batches, by kind.
    decode_units: int = 0
    prefill_units: int = 0
    tokens: int = 0
    # Engine busy: from a batch's start to its outcome, summed; and when the running one started.
    busy_ns: int = 0
    running_since_ns: int | None = None
    # When the first batch started (the window never reaches before it), and the recent
    # batches' (start, end) for the busy fraction.
    first_started_ns: int | None = None
    recent_busy: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=_BUSY_INTERVALS_KEPT))
    sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BOUNDS))
    queue_wait_s: Histogram = field(default_factory=lambda: Histogram(QUEUE_WAIT_BOUNDS_S))
    # The running batch's (decodes, prefills, tokens, share of the range's work it runs), and the
    # step times smoothed from the finished ones (the range's speed the node announces).
    running_work: tuple[int, int, int, float] | None = None
    speed: StageSpeedMeter = field(default_factory=StageSpeedMeter)
    # What computing layers [start, end) of the range costs (any unit); the shard sets the
    # weight bytes a step reads where it knows them. Layers by default.
    range_work: Callable[[int, int], float] = field(default=lambda start, end: float(end - start))

    def _range_share(self, ranges: Sequence[tuple[int, int, int]]) -> float:
        """The mean share of the range's work the steps ran (1 when they ran all of it)."""
        shares = []
        for start, end, effective in ranges:
            whole = self.range_work(start, end)
            part = self.range_work(effective, end)
            if whole > 0 and 0 < part <= whole:
                shares.append(part / whole)
        return sum(shares) / len(shares) if shares else 1.0

    def started(
        self,
        *,
        decodes: int,
        prefills: int,
        tokens: int,
        waits_ns: Sequence[int],
        now_ns: int,
        ranges: Sequence[tuple[int, int, int]] = (),
    ) -> None:
        """A batch began; ``ranges``: each step's (start, end, effective start), its session's range
        and where its route enters it."""
        self.batches += 1
        self.decode_units += decodes
        self.prefill_units += prefills
        self.tokens += tokens
        self.sizes.observe(decodes + prefills)
        for wait in waits_ns:
            self.queue_wait_s.observe(max(0, wait) / SECOND_NS)
        self.running_since_ns = now_ns
        self.running_work = (decodes, prefills, tokens, self._range_share(ranges))
        if self.first_started_ns is None:
            self.first_started_ns = now_ns

    def finished(self, now_ns: int) -> None:
        if self.running_since_ns is not None:
            self.busy_ns += max(0, now_ns - self.running_since_ns)
            self.recent_busy.append((self.running_since_ns, now_ns))
            if self.running_work is not None:
                decodes, prefills, tokens, share = self.running_work
                self.speed.batch_finished(
                    decodes=decodes,
                    prefills=prefills,
                    tokens=tokens,
                    duration_ns=now_ns - self.running_since_ns,
                    range_share=share,
                )
            self.running_since_ns = None
            self.running_work = None

    def busy_ns_at(self, now_ns: int) -> int:
        """Engine busy time up to ``now_ns``, the running batch's share so far included."""
        running = 0 if self.running_since_ns is None else max(0, now_ns - self.running_since_ns)
        return self.busy_ns + running

    def busy_fraction(self, now_ns: int, window_ns: int = BUSY_WINDOW_NS) -> float:
        """The engine's busy share of the ``window_ns`` before ``now_ns`` (of the time since the
        first batch, when that is shorter); 0 before any batch."""
        if self.first_started_ns is None:
            return 0.0
        begin = max(now_ns - window_ns, self.first_started_ns)
        if now_ns <= begin:
            return 1.0 if self.running_since_ns is not None else 0.0
        while self.recent_busy and self.recent_busy[0][1] <= begin:
            self.recent_busy.popleft()
        intervals = list(self.recent_busy)
        if self.running_since_ns is not None:
            intervals.append((self.running_since_ns, now_ns))
        busy = sum(max(0, min(end, now_ns) - max(start, begin)) for start, end in intervals)
        return min(1.0, busy / (now_ns - begin))


__all__ = ["BATCH_SIZE_BOUNDS", "BUSY_WINDOW_NS", "QUEUE_WAIT_BOUNDS_S", "BatchStats", "Histogram"]
