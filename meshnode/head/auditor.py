"""Audits by replica: a share of finished generations recomputed elsewhere and compared hop by hop.

When a generation ends, the head decides (``DriverConfig.audit_rate``, a seeded draw made only
then, so no hop can tell during a generation whether it will be audited) whether to audit it.
An audit replays the units the head sent in the generation's last epoch (its journal,
:mod:`meshnode.dataplane.unit_journal`) on the route with every hop that has a replica moved
to one, up to the last such hop (:mod:`meshnode.head.audit_routes`), gathers the replay's signed commitments, and
compares them with the ones the generation's own hops signed
(:func:`meshnode.audit.comparison.first_divergence`). At the first hop given the same input
that stated another output, a third computation on yet another replica of that range (up to
that hop only) decides: once two nodes agree against a third, the third is convicted
(:func:`meshnode.audit.comparison.judge`) with evidence anyone can check offline, and the
driver stops routing through it at once. Before any replay, the generation's own commitments are
searched for a hop whose signed handoff states other bytes than it committed to
(:func:`meshnode.audit.comparison.forwarding_conviction`): that convicts it with no replica.

Nothing is audited that cannot be replayed faithfully (a unit failed, the session began from a
kept prefix) or has no replica; hops that declare inexact numerics are compared within a
tolerance only and never convicted. Audits run in the background, one at a time, at most
``MAX_WAITING`` waiting; one drawn beyond that is dropped, so audits never pile up behind load.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.interface import SamplingParams
from meshnode.audit.commitment_store import CommitmentStore
from meshnode.audit.comparison import (
    Conviction,
    Statement,
    first_divergence,
    forwarding_conviction,
    judge,
    statements,
)
from meshnode.dataplane.edges.shard_session import SessionConfig, ShardSession, default_client_config
from meshnode.dataplane.route import make_hop
from meshnode.dataplane.unit_journal import UnitJournal
from meshnode.head.audit_routes import decider_route, replay_route
from meshnode.head.candidates import session_fingerprint
from meshnode.head.driver_config import DriverConfig
from meshnode.head.planner import Route, ShardCandidate
from meshnode.head.route_environment import RouteEnvironment
from meshnode.identity import short_id
from meshnode.sansio import SECOND_NS
from meshnode.wire.errors import MeshnodeError
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)

# Third computations tried for one dispute before it is left undecided.
MAX_DECIDERS = 3
# Audits waiting for the one running; one more drawn is dropped (counted as skipped_busy).
MAX_WAITING = 4


@dataclass(frozen=True)
class FinishedGeneration:
    """What a generation leaves for an audit: its name, last epoch and route, and its units."""

    session_id: str
    epoch: int
    route: Route
    journal: UnitJournal
    sampling: SamplingParams


@dataclass
class AuditStats:
    # Generations drawn for an audit, and of those: audited, without a replica, not replayable.
    drawn: int = 0
    audited: int = 0
    without_replica: int = 0
    not_replayable: int = 0
    # Drawn while MAX_WAITING audits already waited.
    skipped_busy: int = 0
    failed: int = 0
    units_compared: int = 0
    checked_within_tolerance: int = 0
    disputes: int = 0
    undecided: int = 0
    convictions: int = 0
    # Short ids of the nodes convicted, in order.
    convicted: list[str] = field(default_factory=list)


class Auditor:
    def __init__(
        self,
        env: RouteEnvironment,
        options: DriverConfig,
        commitments: CommitmentStore,
        convict: Callable[[Conviction], None],
        *,
        excluded: Callable[[], frozenset[bytes]],
        reporter_id: bytes = b"",
        rng: random.Random | None = None,
    ) -> None:
        """``convict``: act on a conviction (the driver's); ``excluded()``: nodes no audit may use
        (those convicted already)."""
        self._env = env
        self._options = options
        self._commitments = commitments
        self._convict = convict
        self._excluded = excluded
        self._reporter_id = reporter_id
        # Seeded where a test needs to know the draws; otherwise from the OS.
        self._rng = rng or random.Random()
        # One audit at a time: each recomputes a whole generation on the replicas.
        self._one_at_a_time = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = AuditStats()

    @property
    def enabled(self) -> bool:
        return self._options.audit_rate > 0

    def finished(self, generation: FinishedGeneration) -> asyncio.Task[None] | None:
        """A generation ended normally: maybe audit it (in the background); the audit's task, or None."""
        if not self.enabled or self._rng.random() >= self._options.audit_rate:
            return None
        self.stats.drawn += 1
        if not generation.journal.replayable:
            self.stats.not_replayable += 1
            return None
        if len(self._tasks) > MAX_WAITING:
            self.stats.skipped_busy += 1
            return None
        task = asyncio.get_running_loop().create_task(self._audit_guarded(generation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settled(self) -> None:
        """Wait for the audits running or waiting now."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _audit_guarded(self, generation: FinishedGeneration) -> None:
        async with self._one_at_a_time:
            try:
                await self.audit(generation)
            except (MeshnodeError, OSError, TimeoutError) as error:
                self.stats.failed += 1
                log.info("audit of generation %s failed: %s", generation.session_id[:8], error)

    def _pick(self, choices: Sequence[ShardCandidate]) -> ShardCandidate:
        return self._rng.choice(list(choices))

    async def audit(self, generation: FinishedGeneration) -> Conviction | None:
        kept = self._commitments.session(generation.session_id, time.monotonic_ns())
        if kept is None:
            self.stats.not_replayable += 1
            return None
        original = statements(kept.commitments, epoch=generation.epoch)
        forwarded = forwarding_conviction(original, reporter_id=self._reporter_id, unix_now_ns=time.time_ns())
        if forwarded is not None:
            log.info(
                "audit of generation %s: %s passed on other bytes than it computed",
                generation.session_id[:8],
                short_id(forwarded.accused),
            )
            self._convicted(forwarded)
            return forwarded
        candidates = self._env.candidates()
        route = replay_route(generation.route, candidates, self._excluded(), self._pick)
        if route is None:
            self.stats.without_replica += 1
            return None
        replay = statements(await self._replay(route, generation))
        hop_layers = [(hop.effective_start_layer, hop.end_layer) for hop in route.hops]
        comparison = first_divergence(original, replay, hop_layers)
        self.stats.audited += 1
        self.stats.units_compared += comparison.compared
        self.stats.checked_within_tolerance += comparison.within_tolerance
        divergence = comparison.divergence
        if divergence is None:
            return None
        self.stats.disputes += 1
        hop_index = hop_layers.index(divergence.key[0])
        log.info(
            "audit of generation %s: %s and %s stated other outputs of layers [%d,%d) at step %d",
            generation.session_id[:8],
            short_id(divergence.original.signer),
            short_id(divergence.replay.signer),
            *divergence.key[0],
            divergence.key[1],
        )
        gathered: list[Statement] = [divergence.original, divergence.replay]
        tried = {divergence.original.signer, divergence.replay.signer}
        for _ in range(MAX_DECIDERS + 1):
            conviction = judge(gathered, reporter_id=self._reporter_id, unix_now_ns=time.time_ns())
            if conviction is not None:
                self._convicted(conviction)
                return conviction
            decider = decider_route(
                route, hop_index, self._env.candidates(), self._excluded() | tried, self._pick
            )
            if decider is None:
                break
            tried.add(decider.hops[hop_index].node_id)
            found = statements(await self._replay(decider, generation)).by_key.get(divergence.key)
            if found is not None:
                gathered.append(found)
        self.stats.undecided += 1
        log.warning(
            "audit of generation %s: a dispute over layers [%d,%d) left undecided (no more replicas)",
            generation.session_id[:8],
            *divergence.key[0],
        )
        return None

    def _convicted(self, conviction: Conviction) -> None:
        self.stats.convictions += 1
        self.stats.convicted.append(short_id(conviction.accused))
        self._convict(conviction)

    async def _replay(self, route: Route, generation: FinishedGeneration) -> list[shard.SignedCommitment]:
        """Send the generation's units on ``route`` in a session of its own; what its hops signed."""
        first = route.hops[0]
        session = await ShardSession.open(
            lambda: self._env.link(first.node_id),
            fingerprint=session_fingerprint(route.model),
            shard_range=shard.ShardRange(
                start_layer=first.start_layer,
                end_layer=first.end_layer,
                effective_start_layer=first.effective_start_layer,
            ),
            downstream=[
                make_hop(hop.node_id, hop.start_layer, hop.end_layer, hop.effective_start_layer)
                for hop in route.hops[1:]
            ],
            sampling=generation.sampling,
            boundary_dtype=self._options.boundary_dtype,
            # Named like any generation's session, its units with deadlines: nothing marks a replay.
            route_session_id=uuid.uuid4().hex,
            config=default_client_config(),
            options=SessionConfig(open_timeout_s=self._options.open_timeout_s),
        )
        collected: list[shard.SignedCommitment] = []
        session.commitment_sink = collected.extend
        try:
            entries = generation.journal.entries
            deadline_unix_ns = time.time_ns() + round(self._options.unit_timeout_s * len(entries) * SECOND_NS)
            handles = [session.submit_replay(entry, deadline_unix_ns=deadline_unix_ns) for entry in entries]
            for handle in handles:
                # A unit that fails ends the replay: what came back before it still compares.
                await asyncio.wait_for(asyncio.shield(handle.future), self._options.unit_timeout_s)
        except (MeshnodeError, TimeoutError) as error:
            log.info("an audit's replay on %s stopped: %s", short_id(first.node_id), error)
        finally:
            await session.aclose()
        return collected


__all__ = ["MAX_DECIDERS", "AuditStats", "Auditor", "FinishedGeneration"]
