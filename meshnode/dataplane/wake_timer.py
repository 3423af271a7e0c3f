"""One loop timer for a sans-IO machine's ``get_timer()``/``handle_timer(now_ns)`` pair, in monotonic nanoseconds.

Arming for a later time than the one already armed keeps the earlier call: it
fires, the owner handles it (nothing is due yet) and re-arms. Most re-arms on the hot
path move the time later (a new unit's deadline is after the previous one's), so
they cost a comparison instead of a cancel and a new loop timer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class WakeTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._at: int | None = None
        self._closed = False

    def arm(self, when_ns: int | None) -> None:
        """Call back at ``when_ns`` (monotonic ns) unless an earlier call is armed; None arms nothing."""
        if when_ns is None or self._closed or (self._at is not None and self._at <= when_ns):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = when_ns
        self._handle = self._loop.call_later(max(0.0, (when_ns - time.monotonic_ns()) / 1e9), self._fire)

    def cancel(self) -> None:
        """Disarm for good."""
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._at = None

    def _fire(self) -> None:
        self._handle = None
        self._at = None
        self._callback()


__all__ = ["WakeTimer"]
