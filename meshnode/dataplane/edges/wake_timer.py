"""The data plane's loop timer: a :class:`~meshnode.timer_edge.TimerEdge` its owner arms with the times it reads.

The session link and the shard server arm it with their machine's ``get_timer()``
after every input and call the machine's ``handle_timer`` themselves in ``callback``,
so the edge has no ``get_timer`` of its own to read again.
"""

from __future__ import annotations

from collections.abc import Callable

from meshnode.timer_edge import TimerEdge


class WakeTimer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self._edge = TimerEdge(get_timer=lambda: None, on_due=lambda _now_ns: callback())

    def arm(self, when_ns: int | None) -> None:
        """Call back at ``when_ns`` (monotonic ns) unless an earlier call is armed; None arms nothing."""
        self._edge.arm(when_ns)

    def cancel(self) -> None:
        """Disarm for good."""
        self._edge.close()


__all__ = ["WakeTimer"]
