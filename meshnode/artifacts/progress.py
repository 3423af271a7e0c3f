"""Transfer progress: a pure record (bytes, rate, ETA), a terminal bar, and a status dict.

:class:`TransferProgress` takes time as a parameter, so its rate and ETA are testable;
the fetcher advances it. :class:`ProgressDisplay` renders it to stderr: a bar redrawn
in place when stderr is a terminal, otherwise one log line every few seconds (a bar in
a log file is noise). ``as_status()`` is what ``meshnode status`` shows.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from typing import TextIO

from meshnode.sansio import SECOND_NS

log = logging.getLogger(__name__)

# The rate is measured over the last few seconds: recent enough to follow a source
# joining or leaving, long enough not to jitter with every chunk.
RATE_WINDOW_NS = 5 * SECOND_NS
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
        self._samples: deque[tuple[int, int]] = deque()

    def begin(self, total_bytes: int, resumed_bytes: int, now_ns: int) -> None:
        self.total_bytes = total_bytes
        self.resumed_bytes = resumed_bytes
        self.done_bytes = resumed_bytes
        self.started_ns = now_ns
        self._samples = deque([(now_ns, self.done_bytes)])

    def advance(self, nbytes: int, now_ns: int) -> None:
        self.done_bytes += nbytes
        self._samples.append((now_ns, self.done_bytes))
        while len(self._samples) > 2 and now_ns - self._samples[1][0] > RATE_WINDOW_NS:
            self._samples.popleft()

    def finish(self) -> None:
        self.finished = True

    def rate(self, now_ns: int) -> float:
        """Bytes per second over the recent window (0 before two samples)."""
        if len(self._samples) < 2:
            return 0.0
        first_ns, first_bytes = self._samples[0]
        elapsed_ns = now_ns - first_ns
        return 0.0 if elapsed_ns <= 0 else (self.done_bytes - first_bytes) * SECOND_NS / elapsed_ns

    def eta_s(self, now_ns: int) -> float | None:
        """Seconds left at the current rate; ``None`` while the rate is unknown."""
        left = max(self.total_bytes - self.done_bytes, 0)
        if left == 0:
            return 0.0
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
            "finished": self.finished,
        }

    def line(self, now_ns: int) -> str:
        """One line of text: label, bytes, percent, rate, ETA."""
        eta = self.eta_s(now_ns)
        eta_text = "--" if eta is None else _duration(eta)
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
