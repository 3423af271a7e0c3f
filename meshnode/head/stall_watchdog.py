"""Whether a generation's route still answers: the hops' liveness probes, and the watchdog that runs them.

A dead peer usually fails silently (its QUIC link does not notice for a long time),
so while a unit stays unanswered for ``stall_probe_s`` the :class:`StallWatchdog`
probes the route's hops and aborts the session as soon as one of them is gone; the
hops it found are the first the recovery excludes (:func:`find_dead_hops` probes
again only when it found none).
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshnode.head.driver_config import DriverConfig
from meshnode.head.planner import Route
from meshnode.head.recovery import ROUTE_FAILURES
from meshnode.head.route_environment import RouteEnvironment
from meshnode.head.route_session import RouteSession
from meshnode.identity import short_id
from meshnode.sansio import SECOND_NS

log = logging.getLogger(__name__)


async def find_dead_hops(env: RouteEnvironment, options: DriverConfig, route: Route) -> set[bytes]:
    """The route's hops that do not answer a liveness probe."""

    async def alive(node_id: bytes) -> bool:
        try:
            # Bounds a check that hangs; the environment bounds each probe itself.
            async with asyncio.timeout(2 * options.probe_timeout_s + 1):
                return await env.alive(node_id, options.probe_timeout_s)
        except ROUTE_FAILURES:  # TimeoutError among them
            return False

    answers = await asyncio.gather(*(alive(hop.node_id) for hop in route.hops))
    return {hop.node_id for hop, answered in zip(route.hops, answers, strict=True) if not answered}


class StallWatchdog:
    """Times the unit a generation awaits and probes its route's hops when it stays unanswered."""

    def __init__(self, env: RouteEnvironment, options: DriverConfig, route: RouteSession) -> None:
        self._env = env
        self._options = options
        self._route = route
        # Monotonic ns the unit now awaited was sent; None between units. Left set when the wait
        # ends in an exception, so the end of the generation knows work was interrupted.
        self._waiting_since_ns: int | None = None
        # Hops of the current route found gone.
        self.found_dead: set[bytes] = set()

    @property
    def interrupted(self) -> bool:
        """Whether a unit was awaited when the generation stopped waiting (a cancel must reach it)."""
        return self._waiting_since_ns is not None

    def waiting(self) -> None:
        """A unit was sent, or one came back and the next is awaited: timed from now."""
        self._waiting_since_ns = time.monotonic_ns()

    def answered(self) -> None:
        """Nothing is awaited (a unit came back, or the wait's failure was handled)."""
        self._waiting_since_ns = None

    def new_route(self) -> None:
        self.found_dead = set()

    async def run(self) -> None:
        """Probe the route's hops while a unit stays unanswered; abort the session if one is gone."""
        stall_ns = round(self._options.stall_probe_s * SECOND_NS)
        interval = self._options.stall_probe_s / 2
        while True:
            await asyncio.sleep(interval)
            since, session, route = self._waiting_since_ns, self._route.session, self._route.route
            if since is None or session is None or route is None:
                continue
            if time.monotonic_ns() - since < stall_ns:
                continue
            dead = await find_dead_hops(self._env, self._options, route)
            if dead and self._route.session is session and self._waiting_since_ns is not None:
                self.found_dead |= dead
                log.warning(
                    "generation %s: hop %s stopped answering; failing over",
                    self._route.route_session_id[:8],
                    ", ".join(short_id(node_id) for node_id in dead),
                )
                session.abort()
            else:
                await asyncio.sleep(self._options.stall_probe_s)


__all__ = ["StallWatchdog", "find_dead_hops"]
