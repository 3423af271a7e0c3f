"""What a generation does when its route fails, as :mod:`meshnode.head.recovery` decides.

A ``CACHE_MISS`` rebuilds the caches under the same route session; any other route
failure finds the hops that are gone, excludes them, re-plans at the next epoch and
replays the session's tokens. A shard that refused the epoch's new session for
capacity is left out of this generation's routes instead, and the next replica tried
(:mod:`meshnode.head.route_choice`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from meshnode.head.backend import ContextLengthExceeded, GenerationFailed
from meshnode.head.driver_config import DriverConfig
from meshnode.head.driver_stats import DriverStats
from meshnode.head.recovery import Recovery, RecoveryPolicy, describe
from meshnode.head.route_choice import RouteChoice
from meshnode.head.route_control import RouteControl
from meshnode.head.route_environment import RouteEnvironment
from meshnode.head.route_session import RouteSession
from meshnode.head.stall_watchdog import StallWatchdog, find_dead_hops
from meshnode.identity import short_id

log = logging.getLogger(__name__)


class RecoveryServices(Protocol):
    """What the recovery asks of the driver that runs every generation."""

    def found_dead(self, node_ids: set[bytes]) -> None:
        """Keep these hops out of every generation's new routes for a while."""
        ...

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` to completion even if this generation goes away."""
        ...


class RouteRecovery:
    def __init__(
        self,
        services: RecoveryServices,
        env: RouteEnvironment,
        options: DriverConfig,
        stats: DriverStats,
        route: RouteSession,
        choice: RouteChoice,
        watchdog: StallWatchdog,
        control: RouteControl,
    ) -> None:
        self._services = services
        self._env = env
        self._options = options
        self._stats = stats
        self._route = route
        self._choice = choice
        self._watchdog = watchdog
        self._control = control
        self._policy = RecoveryPolicy(options.budget)

    def refused_for_capacity(self, refusers: set[bytes], error: BaseException) -> None:
        """Leave the refusing hops out of this generation's routes and drop the epoch's session."""
        self._stats.capacity_refusals += 1
        self._choice.refused(refusers)
        self._watchdog.answered()
        route = self._route
        log.info(
            "generation %s epoch %d: %s refused a new session (%s); trying another replica",
            route.route_session_id[:8],
            route.epoch,
            ", ".join(short_id(node_id) for node_id in refusers),
            describe(error),
        )
        if route.drop() is not None and route.route is not None:
            self._services.spawn(self._control.release_quietly(route.route.hops, route.epoch))

    async def recover(self, error: BaseException) -> None:
        """Act on a route failure: keep the session (its caches are rebuilt next) or drop the route."""
        self._watchdog.answered()
        decision = self._policy.decide(error)
        route_session = self._route
        tag = f"generation {route_session.route_session_id[:8]} epoch {route_session.epoch}"
        if decision.recovery is Recovery.GIVE_UP:
            if decision.request_too_large:
                raise ContextLengthExceeded(decision.reason)
            log.warning("%s failed: %s", tag, decision.reason)
            raise GenerationFailed(decision.reason)
        if decision.recovery is Recovery.REBUILD:
            self._stats.rebuilds += 1
            log.info("%s: %s; re-prefilling under the same route session", tag, decision.reason)
            return
        self._stats.reroutes += 1
        route, old_epoch = route_session.route, route_session.epoch
        route_session.drop()
        if route is None:
            return
        dead = self._watchdog.found_dead & set(route.node_ids) or await find_dead_hops(
            self._env, self._options, route
        )
        self._choice.exclude(dead)
        self._services.found_dead(dead)
        alive = [hop for hop in route.hops if hop.node_id not in dead]
        self._services.spawn(self._control.release_quietly(alive, old_epoch))
        if dead:
            gone = ", ".join(short_id(node_id) for node_id in dead)
            log.warning("%s: %s; re-routing (gone: %s)", tag, decision.reason, gone)
        else:
            delay = self._policy.settle_delay_s()
            log.warning("%s: %s; every hop answers: re-routing in %.1f s", tag, decision.reason, delay)
            await asyncio.sleep(delay)


__all__ = ["RecoveryServices", "RouteRecovery"]
