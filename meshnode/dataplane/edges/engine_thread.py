"""One thread per engine that runs its blocking calls in submission order.

Engines are synchronous and not re-entrant, and a step may take seconds, so no
engine call ever runs on the event loop. A plain thread with a FIFO queue is
cheaper on the hot path than an executor (one queue put and one
``call_soon_threadsafe`` per call) and makes the order explicit: a
``ReleaseEngine`` submitted after a ``RunBatch`` runs after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)

T = TypeVar("T")
Done = Callable[[object], None]


class EngineThreadClosed(RuntimeError):
    """The engine thread was stopped; nothing more runs on it."""


class EngineThread:
    def __init__(self, name: str = "meshnode-engine") -> None:
        self._loop = asyncio.get_running_loop()
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Done | None] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, on_done: Done | None = None) -> None:
        """Run ``fn(*args)`` on the engine thread after everything submitted before it; then call
        ``on_done(result)`` on the loop, where ``result`` is the return value or the exception."""
        if self._stopped:
            raise EngineThreadClosed("the engine thread is stopped")
        self._jobs.put((fn, args, on_done))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread, awaited; its exception is raised here."""
        future: asyncio.Future[T] = self._loop.create_future()

        def settle(outcome: object) -> None:
            if future.done():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(cast(T, outcome))  # what fn returned: on_done hears it as an object

        self.submit(fn, *args, on_done=settle)
        return await future

    async def stop(self, timeout: float = 10.0) -> bool:
        """Run what is queued, then end the thread. False when it is still busy after ``timeout``
        (a step that ignores cancellation); the daemon thread then ends with the process."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, on_done = job
            try:
                outcome: object = fn(*args)
            except Exception as exc:  # the caller decides what a failure means
                outcome = exc
            if on_done is not None:
                # RuntimeError: the loop closed under us (process exit); nobody waits any more.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(on_done, outcome)
            elif isinstance(outcome, Exception):
                log.warning("engine call %s failed: %s", getattr(fn, "__name__", fn), type(outcome).__name__)


__all__ = ["EngineThread", "EngineThreadClosed"]
