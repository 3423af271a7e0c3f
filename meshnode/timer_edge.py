"""The one asyncio edge for a sans-IO machine's timer: ``handle_timer(now_ns)`` when ``get_timer()`` comes due.

Every machine of :mod:`meshnode.sansio` says when it next has work as ``get_timer()``
(monotonic nanoseconds, or None) and does it in ``handle_timer(now_ns)``. A
:class:`TimerEdge` holds the one loop timer that joins the two: it reads ``get_timer()``,
calls ``on_due(now_ns)`` (the machine's ``handle_timer``, and whatever its owner drains
after it) when that time comes, and reads ``get_timer()`` again after each call. Its
owner calls :meth:`TimerEdge.rearm` after an input that may have moved the time earlier.
The data plane, the QUIC transport, the node's heartbeat and the relay server all run
their timers on it.

Arming for a later time than the one already armed keeps the earlier call: it fires,
the machine finds nothing due (calling early is harmless, :mod:`meshnode.sansio`) and
the edge re-arms. Most re-arms on a hot path move the time later (a new unit's deadline
is after the previous one's, a packet received pushes QUIC's idle timeout on), so they
cost a comparison instead of a cancel and a new loop timer.

``on_due`` gets the later of the armed time and the clock: a loop may run a timer a
little before its time (its clock's resolution, a millisecond on uvloop), and a machine
told a time before its own timer would only ask to be woken again at once. The clock is
``time.monotonic_ns`` unless the machine already keeps another one: QUIC's runs on the
event loop's (``loop.time()``, which uvloop reads from a coarser monotonic clock, a few
milliseconds behind), and its timer must hand it times of that same clock, or its RTT samples
would mix two clocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from meshnode.sansio import SECOND_NS


class TimerEdge:
    def __init__(
        self,
        get_timer: Callable[[], int | None],
        on_due: Callable[[int], None],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._get_timer = get_timer
        self._on_due = on_due
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._at: int | None = None
        self._closed = False

    def rearm(self) -> None:
        """Read ``get_timer()`` again (after an input that may have moved it earlier)."""
        self.arm(self._get_timer())

    def arm(self, when_ns: int | None) -> None:
        """Call ``on_due`` at ``when_ns`` (monotonic ns) unless an earlier call is armed; None arms nothing."""
        if when_ns is None or self._closed or (self._at is not None and self._at <= when_ns):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = when_ns
        self._handle = self._loop.call_later(max(0, when_ns - self._clock()) / SECOND_NS, self._fire)

    def cancel(self) -> None:
        """Disarm what is armed; a later :meth:`rearm` or :meth:`arm` arms again."""
        self._disarm()

    def close(self) -> None:
        """Disarm for good."""
        self._closed = True
        self._disarm()

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._at = None

    def _fire(self) -> None:
        at = self._at
        self._handle = None
        self._at = None
        assert at is not None
        self._on_due(max(at, self._clock()))
        self.rearm()


async def run_timer(get_timer: Callable[[], int | None], on_due: Callable[[int], None]) -> None:
    """A :class:`TimerEdge` for as long as the task awaiting this runs: cancelling the task stops it."""
    edge = TimerEdge(get_timer, on_due)
    edge.rearm()
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        edge.close()


__all__ = ["TimerEdge", "run_timer"]
