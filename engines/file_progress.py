"""Progress of long passes over a model file on first start (hashing it, writing a slice).

Hashing a multi-gigabyte GGUF, or copying a layer range out of it, takes minutes on
first start; without this the node says nothing meanwhile. A :class:`FileProgress` is
the ``progress`` callback that :func:`engines.model_manifest.cached_manifest`,
:func:`engines.file_digest.sha256_file` and :func:`engines.gguf_file.write_gguf` call
with each block's size. It shows nothing until the first block (a remembered manifest
or an already written slice costs no pass and so no output), then:

- on a terminal, a bar redrawn in place (tqdm, which the ``gguf`` dependency brings);
- otherwise one log line every few seconds (a bar in a log file is noise), and one
  when the pass ends;
- and, while it runs, in :func:`passes_in_progress`, which ``meshnode status`` shows
  (the pass runs on a worker thread; the status socket asks from the event loop).

Time is a parameter (``clock``), so rates and log cadence are testable.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0
_MIB = 1 << 20

# The passes begun and not yet closed, in this process.
_running: list[FileProgress] = []
_running_lock = threading.Lock()


def passes_in_progress(now: float | None = None) -> list[dict[str, Any]]:
    """What each running pass has done: label, bytes done and total, fraction, rate, ETA."""
    with _running_lock:
        running = list(_running)
    return [progress.to_json(progress.now() if now is None else now) for progress in running]


class FileProgress:
    """Bytes read of ``total_bytes``; call it with each block's size, close it when done."""

    def __init__(
        self,
        label: str,
        total_bytes: int,
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self.finished = False
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._started_s: float | None = None
        self._logged_s = 0.0
        self._bar: Any = None  # a tqdm bar, on a terminal

    # -- the callback -----------------------------------------------------------------

    def __call__(self, nbytes: int) -> None:
        now = self._clock()
        if self._started_s is None:
            self._begin(now)
        self.done_bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        elif now - self._logged_s >= self._log_interval_s:
            self._logged_s = now
            log.info("%s", self.line(now))

    def _begin(self, now: float) -> None:
        self._started_s = self._logged_s = now
        with _running_lock:
            _running.append(self)
        if getattr(self._stream, "isatty", lambda: False)():
            from tqdm import tqdm  # only on a terminal; gguf depends on it

            self._bar = tqdm(
                total=self.total_bytes,
                desc=self.label,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self._stream,
                leave=True,
                dynamic_ncols=True,
            )
        else:
            log.info("%s: %.1f MiB to go", self.label, self.total_bytes / _MIB)

    def close(self) -> None:
        """The read ended (or failed); a last line when anything was shown."""
        if self.finished:
            return
        self.finished = True
        if self._started_s is None:
            return
        with _running_lock:
            _running.remove(self)
        if self._bar is not None:
            self._bar.close()
        else:
            elapsed = self._clock() - self._started_s
            log.info("%s: %.1f MiB in %.1f s", self.label, self.done_bytes / _MIB, elapsed)

    def __enter__(self) -> FileProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    # -- what it shows ----------------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes <= 0 else min(self.done_bytes / self.total_bytes, 1.0)

    def rate(self, now: float) -> float:
        """Bytes per second since the first block."""
        if self._started_s is None or now <= self._started_s:
            return 0.0
        return self.done_bytes / (now - self._started_s)

    def eta_s(self, now: float) -> float | None:
        rate = self.rate(now)
        return max(self.total_bytes - self.done_bytes, 0) / rate if rate > 0 else None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "label": self.label,
            "done_bytes": self.done_bytes,
            "total_bytes": self.total_bytes,
            "fraction": self.fraction,
            "rate_bytes_per_s": self.rate(now),
            "eta_s": self.eta_s(now),
        }

    def line(self, now: float) -> str:
        """``hashing gemma.gguf: 120.0/253.0 MiB 47.4% 85.2 MiB/s ETA 2 s``"""
        eta = self.eta_s(now)
        return (
            f"{self.label}: {self.done_bytes / _MIB:.1f}/{self.total_bytes / _MIB:.1f} MiB "
            f"{self.fraction * 100:.1f}% {self.rate(now) / _MIB:.1f} MiB/s"
            + ("" if eta is None else f" ETA {eta:.0f} s")
        )


__all__ = ["LOG_INTERVAL_S", "FileProgress", "passes_in_progress"]
