"""The unary control calls a generation makes to its route's hops: Cancel and Release, each bounded.

Closing a generation's token stream ends it everywhere (:meth:`RouteControl.end`):
when a unit is still running, the session's out-of-band Cancel goes to the first
hop (which passes it on) and a unary Cancel to every other hop directly, so a
chain wedged between two hops still stops; then the session is released, in band
and with a unary Release to every hop. An abandoned epoch (a route given up for
another) is released on the hops still alive (:meth:`RouteControl.release_quietly`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

from meshnode.dataplane.edges import rpc
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.envelope import HIGHEST_SCHEMA_VERSION
from meshnode.head.driver_config import DriverConfig
from meshnode.head.planner import Hop
from meshnode.head.recovery import ROUTE_FAILURES
from meshnode.head.route_environment import RouteEnvironment
from meshnode.identity import short_id
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CancelReport:
    """How the end of an interrupted generation reached its route."""

    route_session_id: str
    route_epoch: int
    hops: tuple[str, ...]
    # Hops that answered the unary Cancel (the first hop through the session's own Cancel).
    cancel_acknowledged: tuple[str, ...]
    # Hops that answered the unary Release.
    release_acknowledged: tuple[str, ...]


class RouteControl:
    """One generation's control calls (its route session id) to the hops of any of its epochs."""

    def __init__(self, env: RouteEnvironment, options: DriverConfig, route_session_id: str) -> None:
        self._env = env
        self._options = options
        self._route_session_id = route_session_id

    async def end(
        self, session: ShardSession, hops: Sequence[Hop], epoch: int, *, interrupted: bool
    ) -> CancelReport | None:
        """Close the epoch's session and release it; cancelled first on every hop when ``interrupted``
        (a unit was still running), and then how that reached the route."""
        timeout = self._options.control_timeout_s
        if not interrupted:
            await session.aclose(release=True, timeout=timeout)
            return None
        cancels = await asyncio.gather(
            self._bounded(session.cancel(reason="the generation was closed")),
            *(self._cancel(hop, epoch) for hop in hops[1:]),
        )
        await session.aclose(release=True, timeout=timeout)
        releases = await asyncio.gather(*(self._release(hop, epoch) for hop in hops))
        report = CancelReport(
            route_session_id=self._route_session_id,
            route_epoch=epoch,
            hops=tuple(short_id(hop.node_id) for hop in hops),
            cancel_acknowledged=tuple(short_id(h.node_id) for h, ok in zip(hops, cancels, strict=True) if ok),
            release_acknowledged=tuple(
                short_id(h.node_id) for h, ok in zip(hops, releases, strict=True) if ok
            ),
        )
        log.info(
            "generation %s closed mid-step: cancel acknowledged by %d of %d hops",
            self._route_session_id[:8],
            len(report.cancel_acknowledged),
            len(hops),
        )
        return report

    async def release_quietly(self, hops: Sequence[Hop], epoch: int) -> None:
        """Drop an abandoned epoch's state on the hops still alive (a newer epoch would too)."""
        await asyncio.gather(*(self._release(hop, epoch) for hop in hops))

    async def _bounded(self, call: Awaitable[object]) -> bool:
        try:
            async with asyncio.timeout(self._options.control_timeout_s):
                await call
            return True
        except ROUTE_FAILURES as exc:  # TimeoutError among them
            log.debug("generation %s: control call failed: %s", self._route_session_id[:8], exc)
            return False

    async def _cancel(self, hop: Hop, epoch: int) -> bool:
        request = shard.CancelRequest(
            schema_version=HIGHEST_SCHEMA_VERSION,
            route_session_id=self._route_session_id,
            route_epoch=epoch,
            reason="the generation was closed",
        )

        async def call() -> None:
            link = await self._env.link(hop.node_id)
            await rpc.send_cancel(link, request, timeout=self._options.control_timeout_s)

        return await self._bounded(call())

    async def _release(self, hop: Hop, epoch: int) -> bool:
        request = shard.ReleaseRequest(
            schema_version=HIGHEST_SCHEMA_VERSION,
            route_session_id=self._route_session_id,
            route_epoch=epoch,
        )

        async def call() -> None:
            link = await self._env.link(hop.node_id)
            await rpc.send_release(link, request, timeout=self._options.control_timeout_s)

        return await self._bounded(call())


__all__ = ["CancelReport", "RouteControl"]
