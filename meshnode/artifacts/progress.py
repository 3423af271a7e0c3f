"""Transfer progress: a pure record (bytes, rate, ETA), a terminal bar, and a status dict.

:class:`TransferProgress` takes time as a parameter, so its rate and ETA are testable;
the fetcher advances it. :class:`ProgressDisplay` renders it to stderr: a bar redrawn
in place when stderr is a terminal, otherwise one log line every few seconds (a bar in
a log file is noise). ``as_status()`` is what ``meshnode status`` shows.

The rate is an exponentially weighted average of the bytes over time (time constant
:data:`RATE_TIME_CONSTANT_NS`), weighted over the time the transfer has actually run:
in its first seconds it is the plain average since the start, later it follows the
recent past, so a source that joins or leaves moves it within a few time constants and
one fast or slow chunk does not. The ETA waits :data:`ETA_AFTER_NS` ("estimating"): the
first seconds of a fetch are the connection's slow start and the first chunks' bursts,
and a figure from them was off by 2-3x on the 8B run (issue 53).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from typing import TextIO

from meshnode.sansio import SECOND_NS

log = logging.getLogger(__name__)

# Long enough that a chunk's burst or a short stall barely moves the rate, short enough
# that a halved rate (a second joiner sharing the source) shows within about a minute.
RATE_TIME_CONSTANT_NS = 20 * SECOND_NS
# No ETA before the transfer has run this long: until then it says "estimating".
ETA_AFTER_NS = 10 * SECOND_NS
ESTIMATING = "estimating"
LOG_INTERVAL_S = 5.0
BAR_INTERVAL_S = 0.2
_BAR_WIDTH = 30


class TransferProgress:
    def __init__(self, label: str = "model") -> None:
        self.label = label
        self.total_bytes = 0
        self.done_bytes = 0
        # Bytes already on disk when the transfer began (a resume), counted as done.
        self.resumed_bytes = 0
        self.started_ns: int | None = None
        self.finished = False
        # The bytes received since begin(), each weighted by exp(-age / time constant), as of
        # _decayed_at_ns: the rate's numerator, kept up to date in O(1) per chunk.
        self._decayed_bytes = 0.0
        self._decayed_at_ns = 0

    def begin(self, total_bytes: int, resumed_bytes: int, now_ns: int) -> None:
        self.total_bytes = total_bytes
        self.resumed_bytes = resumed_bytes
        self.done_bytes = resumed_bytes
        self.started_ns = now_ns
        self._decayed_bytes = 0.0
        self._decayed_at_ns = now_ns

    def advance(self, nbytes: int, now_ns: int) -> None:
        self.done_bytes += nbytes
        self._decayed_bytes = self._decayed_to(now_ns) + nbytes
        self._decayed_at_ns = max(now_ns, self._decayed_at_ns)

    def finish(self) -> None:
        self.finished = True

    def _decayed_to(self, now_ns: int) -> float:
        age_ns = max(now_ns - self._decayed_at_ns, 0)
        return self._decayed_bytes * math.exp(-age_ns / RATE_TIME_CONSTANT_NS)

    def rate(self, now_ns: int) -> float:
        """Bytes per second, exponentially weighted towards the recent past (0 before any time
        has passed). The weights are normalised over the time since begin(), so the early rate
        is the average so far rather than one biased towards zero."""
        if self.started_ns is None:
            return 0.0
        elapsed_ns = now_ns - self.started_ns
        if elapsed_ns <= 0:
            return 0.0
        # The integral of exp(-age / tau) over the elapsed time, in seconds.
        weighted_s = RATE_TIME_CONSTANT_NS * -math.expm1(-elapsed_ns / RATE_TIME_CONSTANT_NS) / SECOND_NS
        return self._decayed_to(now_ns) / weighted_s

    def estimating(self, now_ns: int) -> bool:
        """Whether it is too early for an ETA (the transfer has run less than ETA_AFTER_NS)."""
        return self.started_ns is None or now_ns - self.started_ns < ETA_AFTER_NS

    def eta_s(self, now_ns: int) -> float | None:
        """Seconds left at the current rate; ``None`` while estimating or nothing is arriving."""
        left = max(self.total_bytes - self.done_bytes, 0)
        if left == 0:
            return 0.0
        if self.estimating(now_ns):
            return None
        rate = self.rate(now_ns)
        return left / rate if rate > 0 else None

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes == 0 else min(self.done_bytes / self.total_bytes, 1.0)

    def as_status(self, now_ns: int | None = None) -> dict[str, object]:
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        eta = self.eta_s(now_ns)
        return {
            "label": self.label,
            "done_bytes": self.done_bytes,
            "total_bytes": self.total_bytes,
            "resumed_bytes": self.resumed_bytes,
            "fraction": round(self.fraction, 4),
            "rate_bytes_per_s": round(self.rate(now_ns)),
            "eta_s": None if eta is None else round(eta, 1),
            # Too early for an ETA (eta_s is None): `meshnode status` says "ETA estimating".
            "estimating": eta is None and self.estimating(now_ns),
            "finished": self.finished,
        }

    def line(self, now_ns: int) -> str:
        """One line of text: label, bytes, percent, rate, ETA."""
        eta = self.eta_s(now_ns)
        eta_text = (ESTIMATING if self.estimating(now_ns) else "--") if eta is None else _duration(eta)
        return (
            f"{self.label}: {_mib(self.done_bytes)}/{_mib(self.total_bytes)} MiB "
            f"{self.fraction * 100:5.1f}% {_mib(int(self.rate(now_ns)))} MiB/s ETA {eta_text}"
        )

    def bar(self, now_ns: int) -> str:
        filled = int(self.fraction * _BAR_WIDTH)
        return f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {self.line(now_ns)}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """Shows a :class:`TransferProgress` on ``stream`` (stderr) while :meth:`run` runs."""

    def __init__(self, progress: TransferProgress, stream: TextIO | None = None) -> None:
        self.progress = progress
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())

    def show(self, now_ns: int) -> None:
        if self.live:
            self.stream.write("\r" + self.progress.bar(now_ns) + "\x1b[K")
            self.stream.flush()
        else:
            log.info("%s", self.progress.line(now_ns))

    async def run(self) -> None:
        """Redraw (or log) until cancelled or the transfer finished; always ends with a last frame."""
        interval = BAR_INTERVAL_S if self.live else LOG_INTERVAL_S
        try:
            while not self.progress.finished:
                await asyncio.sleep(interval)
                self.show(time.monotonic_ns())
        finally:
            self.show(time.monotonic_ns())
            if self.live:
                self.stream.write("\n")
                self.stream.flush()


__all__ = ["ProgressDisplay", "TransferProgress"]
