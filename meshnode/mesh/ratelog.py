"""Logging that a misbehaving peer cannot turn into a flood."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s``; the rest are counted and summarised."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 20,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._window_start = float("-inf")
        self._lines = 0
        self.suppressed = 0

    def log(self, level: int, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start > self._window_s:
            if self.suppressed:
                self._logger.log(level, "... and %d more like it (not logged)", self.suppressed)
            self._window_start, self._lines, self.suppressed = now, 0, 0
        if self._lines < self._burst:
            self._lines += 1
            self._logger.log(level, message, *args)
        else:
            self.suppressed += 1


__all__ = ["RateLimitedLog"]
