"""One generation's session on its current route, epoch by epoch: opening it, holding it, dropping it.

Each epoch opens one :class:`~meshnode.dataplane.edges.shard_session.ShardSession` to the
first hop with the other hops as its downstream (activations flow shard to shard;
only the tail's sampled token comes back). On a route of more than one hop the
token comes back directly: the session opens an answer stream to the tail (over the
head's own link to it), so a token costs one message back instead of one per stage
(``DriverConfig.direct_answer``). The sessions an epoch holds are counted in the
driver's :class:`~meshnode.head.session_load.SessionLedger` from its opening to its
drop, so this head's next routes spread before gossip reports them.

Which hops refused a new session for capacity is read here too
(:meth:`RouteSession.capacity_refusers`): it depends on how far the epoch's session got.
"""

from __future__ import annotations

import logging
import time

from engines.interface import SamplingParams
from meshnode.audit.commitment_store import CommitmentStore
from meshnode.dataplane.edges.shard_session import (
    DirectAnswers,
    SessionConfig,
    ShardSession,
    default_client_config,
)
from meshnode.dataplane.route import make_hop
from meshnode.dataplane.unit_journal import UnitJournal
from meshnode.head.candidates import session_fingerprint
from meshnode.head.driver_config import DriverConfig
from meshnode.head.driver_stats import DriverStats
from meshnode.head.numerics import describe_numerics, mixes_numerics, system_fingerprint
from meshnode.head.pipeline import pipeline_stages
from meshnode.head.planner import Hop, ModelIdentity, Route
from meshnode.head.route_environment import RouteEnvironment
from meshnode.head.session_load import SessionLedger
from meshnode.identity import short_id
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

log = logging.getLogger(__name__)


class RouteSession:
    def __init__(
        self,
        env: RouteEnvironment,
        options: DriverConfig,
        stats: DriverStats,
        ledger: SessionLedger,
        model: ModelIdentity,
        sampling: SamplingParams,
        route_session_id: str,
        commitments: CommitmentStore | None = None,
        *,
        journals: bool = False,
        background: bool = False,
    ) -> None:
        """``commitments``: where the hops' signed commitments for this generation are kept (None:
        nowhere); ``journals``: keep each epoch's units for an audit to replay (:attr:`journal`);
        ``background``: work no client waits on (meshnode.head.answer_keeping), which neither
        reports its route as the last one nor logs how it computes."""
        self._background = background
        self._env = env
        self._commitments = commitments
        self._journals = journals
        # The units sent in the current epoch (None: not kept, or no session opened yet).
        self.journal: UnitJournal | None = None
        self._options = options
        self._stats = stats
        self._ledger = ledger
        self._model = model
        self._sampling = sampling
        self.route_session_id = route_session_id
        self.epoch = 0
        self.route: Route | None = None
        self.session: ShardSession | None = None
        # Where the current epoch's session is: the first hop accepted it (opened), and every hop
        # did (admitted, once the first unit came back).
        self.opened = False
        self.admitted = False
        # The hops of the session open now, as counted in the ledger.
        self._held: tuple[bytes, ...] = ()
        self._fingerprinted_route: Route | None = None
        self._fingerprint: str | None = None

    @property
    def system_fingerprint(self) -> str | None:
        """How the current route computes; None before one is planned. Computed once per route:
        the API asks for it with every token, and it is a JSON digest."""
        route = self.route
        if route is None:
            return None
        if self._fingerprinted_route is not route:
            self._fingerprint = system_fingerprint(route, self._options.boundary_dtype)
            self._fingerprinted_route = route
        return self._fingerprint

    def next_epoch(self) -> None:
        """A new epoch begins (its route is planned next): nothing of it is open yet."""
        self.epoch += 1
        self.opened = self.admitted = False

    async def open(self, route: Route) -> ShardSession:
        """Open the epoch's session on ``route`` and count its hops as held."""
        self.route = route
        stats, options = self._stats, self._options
        if not self._background:
            stats.last_route = tuple(short_id(hop.node_id) for hop in route.hops)
            stats.last_route_numerics = tuple(hop.numerics for hop in route.hops)
            stats.last_system_fingerprint = self.system_fingerprint or ""
        tag = f"generation {self.route_session_id[:8]} epoch {self.epoch}"
        if mixes_numerics(route) and not self._background:
            log.info(
                "%s: the route mixes numerics (%s); its numbers may differ "
                "slightly from a run on one configuration",
                tag,
                describe_numerics(route),
            )
        first = route.hops[0]
        link_to_first = first.node_id
        stages = pipeline_stages(options.pipeline, route.hops, options.pipeline_cohorts)
        stats.last_route_cohorts = stages
        if stages:
            stats.routes_in_cohorts += 1
        else:
            stats.routes_in_one_batch += 1
        log.debug(
            "%s: route %s, %s",
            tag,
            " -> ".join(_hop_text(hop) for hop in route.hops),
            f"its stages kept busy in {stages} cohorts" if stages else "its sessions in one batch a stage",
        )
        tail = route.hops[-1]
        answers = None
        if options.direct_answer and len(route.hops) > 1:
            link_to_tail = tail.node_id
            answers = DirectAnswers(
                links=lambda: self._env.link(link_to_tail),
                tail_range=shard.ShardRange(
                    start_layer=tail.start_layer,
                    end_layer=tail.end_layer,
                    effective_start_layer=tail.effective_start_layer,
                ),
            )
        session = await ShardSession.open(
            lambda: self._env.link(link_to_first),
            fingerprint=session_fingerprint(self._model),
            shard_range=shard.ShardRange(
                start_layer=first.start_layer,
                end_layer=first.end_layer,
                effective_start_layer=first.effective_start_layer,
            ),
            downstream=[
                make_hop(hop.node_id, hop.start_layer, hop.end_layer, hop.effective_start_layer)
                for hop in route.hops[1:]
            ],
            sampling=self._sampling,
            boundary_dtype=options.boundary_dtype,
            pipeline_stages=stages,
            route_session_id=self.route_session_id,
            route_epoch=self.epoch,
            config=default_client_config(),
            options=SessionConfig(open_timeout_s=options.open_timeout_s),
            answers=answers,
        )
        self.journal = UnitJournal() if self._journals else None
        session.client.journal = self.journal
        store = self._commitments
        if store is not None:
            key, hops = self.route_session_id, len(route.hops)
            # One commitment a hop at most: an Ack carrying more is not believed for the rest.
            session.commitment_sink = lambda signed: store.add(key, signed[:hops], time.monotonic_ns())
        self.session = session
        self.opened = True
        self._held = route.node_ids
        self._ledger.hold(self._held)
        return session

    def mark_admitted(self) -> None:
        """A unit came back: every hop accepted the epoch's session."""
        self.admitted = True

    def drop(self) -> ShardSession | None:
        """Abort the epoch's session (if one is open) and stop counting its hops; returns it."""
        session, self.session = self.session, None
        self.release_hold()
        if session is not None:
            session.abort()
        return session

    def take_for_end(self) -> ShardSession | None:
        """The open session, handed over to close it (the generation is over); None if none is."""
        session, self.session = self.session, None
        return session

    def release_hold(self) -> None:
        self._ledger.release(self._held)
        self._held = ()

    def capacity_refusers(self, error: BaseException) -> set[bytes]:
        """The hops that refused the epoch's new session for capacity (empty: not such a refusal).

        The first hop refuses at open; a later hop's refusal comes back on the first unit, passed on
        as "next hop refused" without naming the hop: of the hops after the first, those this head
        sees the most loaded (gossip and its own sessions) are taken for it."""
        route = self.route
        if (
            route is None
            or self.admitted
            or not isinstance(error, ShardProtocolError)
            or error.code != shard.ERROR_CODE_RESOURCE_EXHAUSTED
            or not error.retryable
        ):
            return set()
        if not self.opened:
            return {route.hops[0].node_id}
        downstream = [hop.node_id for hop in route.hops[1:]]
        if not downstream or not error.detail.startswith("next hop refused"):
            return {route.hops[0].node_id}
        load = {c.node_id: c.load for c in self._ledger.adjust(self._env.candidates())}
        most = max(load.get(node_id, 0.0) for node_id in downstream)
        return {node_id for node_id in downstream if load.get(node_id, 0.0) == most}


def _hop_text(hop: Hop) -> str:
    return f"{short_id(hop.node_id)}[{hop.effective_start_layer}:{hop.end_layer})"


__all__ = ["RouteSession"]
