"""Which route a generation's next epoch takes: around the hops it found gone and those that refused it
a session for capacity, waiting for room when only those are left.

Capacity (:mod:`meshnode.head.session_load`): routes avoid shards at capacity while
others exist. A shard that refuses a new session for capacity (RESOURCE_EXHAUSTED,
retryable, before the session's first result) is left out of this generation's routes
and the next replica tried; when none is left, a generation that has produced nothing
yet fails with :class:`~meshnode.head.backend.MeshBusy` (the API's 429). One that has
produced tokens is never dropped for capacity: it waits for room, up to
``capacity_wait_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from meshnode.head.backend import GenerationFailed, MeshBusy
from meshnode.head.driver_config import DriverConfig
from meshnode.head.planner import ModelIdentity, NoRouteError, Route
from meshnode.head.transcript import Transcript
from meshnode.sansio import SECOND_NS


class RoutePlanner(Protocol):
    def plan(self, model: ModelIdentity, exclude: set[bytes], prompt: Sequence[int] = ()) -> Route:
        """The route for a generation of ``prompt`` avoiding ``exclude`` (the cheapest, or one
        holding a prefix of the prompt); raises NoRouteError when there is none."""
        ...


class RouteChoice:
    def __init__(
        self, planner: RoutePlanner, options: DriverConfig, model: ModelIdentity, transcript: Transcript
    ) -> None:
        self._planner = planner
        self._options = options
        self._model = model
        self._transcript = transcript
        # Hops found gone: out of this generation's routes for good.
        self._excluded: set[bytes] = set()
        # Shards that refused this generation a session for capacity: out of its routes until no
        # route is left without them.
        self._busy: set[bytes] = set()
        # Monotonic ns until which a started generation waits for room (None: not waiting).
        self._room_deadline_ns: int | None = None

    def exclude(self, gone: Iterable[bytes]) -> None:
        self._excluded.update(gone)

    def refused(self, refusers: Iterable[bytes]) -> None:
        """These shards refused a new session for capacity."""
        self._busy.update(refusers)

    def opened(self) -> None:
        """A route's session opened: no longer waiting for room."""
        self._room_deadline_ns = None

    async def plan(self) -> Route:
        """The next route: around dead hops and hops that refused for capacity; with none left
        but for those, MeshBusy before the first token, or a wait for room after it."""
        options = self._options
        while True:
            try:
                return self._planner.plan(self._model, self._excluded | self._busy, self._transcript.prompt)
            except NoRouteError as exc:
                if not self._busy:
                    raise GenerationFailed(str(exc)) from None
                if not self._transcript.started:
                    raise MeshBusy(
                        f"every route's shards are at capacity ({len(self._busy)} refused a new session); "
                        "retry shortly",
                        retry_after_s=options.busy_retry_after_s,
                    ) from None
            now_ns = time.monotonic_ns()
            if self._room_deadline_ns is None:
                self._room_deadline_ns = now_ns + round(options.capacity_wait_s * SECOND_NS)
            if now_ns >= self._room_deadline_ns:
                raise GenerationFailed(
                    f"no shard had room to continue the generation within {options.capacity_wait_s:g} s"
                )
            await asyncio.sleep(options.capacity_retry_s)
            # Sessions end all the time: every replica may be asked again.
            self._busy.clear()


__all__ = ["RouteChoice", "RoutePlanner"]
