"""What a node runs on its own until shutdown: heartbeats, probes, reconnects, farewells."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``coro`` until it ends or :meth:`stop`; a failure is logged, not raised."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    @property
    def running(self) -> frozenset[asyncio.Task[Any]]:
        return frozenset(self._tasks)

    async def stop(self) -> None:
        """Cancel every task and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())


__all__ = ["BackgroundTasks"]
