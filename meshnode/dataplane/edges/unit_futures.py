"""The caller's side of a shard session's units: one future each, and one for the session's acceptance.

:class:`SessionFutures` owns them and settles them from the session client's events (a unit
done or failed, the session accepted or over); a handle whose caller went away never leaves a
loop warning behind (its failure is marked as seen).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from meshnode.dataplane.client_events import ClientEvent, SessionFailed, SessionReady, UnitDone, UnitFailed
from meshnode.dataplane.step_outputs import StepOutput
from meshnode.wire.errors import MeshnodeError


@dataclass(frozen=True, slots=True)
class UnitHandle:
    """One submitted unit; ``await handle`` gives its :class:`StepOutput` or raises its error."""

    unit_id: int
    future: asyncio.Future[StepOutput]

    def __await__(self) -> Any:
        return self.future.__await__()


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Mark a failure as seen: a caller that abandoned a handle must not get a loop warning.
    if not future.cancelled():
        future.exception()


class SessionFutures:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._units: dict[int, asyncio.Future[StepOutput]] = {}
        # Settled when the worker accepts the session, or with why it never will.
        self.ready: asyncio.Future[None] = loop.create_future()
        self.ready.add_done_callback(_retrieve)

    def handles(self, unit_ids: Iterable[int]) -> list[UnitHandle]:
        handles = []
        for unit_id in unit_ids:
            future: asyncio.Future[StepOutput] = self._loop.create_future()
            future.add_done_callback(_retrieve)
            self._units[unit_id] = future
            handles.append(UnitHandle(unit_id, future))
        return handles

    def settle(self, event: ClientEvent) -> None:
        match event:
            case UnitDone():
                future = self._units.pop(event.unit_id, None)
                if future is not None and not future.done():
                    future.set_result(StepOutput(event))
            case UnitFailed():
                future = self._units.pop(event.unit_id, None)
                if future is not None and not future.done():
                    future.set_exception(event.error)
            case SessionReady():
                if not self.ready.done():
                    self.ready.set_result(None)
            case SessionFailed():
                if not self.ready.done():
                    self.ready.set_exception(event.error)

    def fail_all(self, error: MeshnodeError) -> None:
        """Every unit still waiting fails with ``error``."""
        for future in self._units.values():
            if not future.done():
                future.set_exception(error)
        self._units.clear()


__all__ = ["SessionFutures", "UnitHandle"]
