"""A node with no ``--model`` places itself: wait for a model in gossip, claim, fetch, serve, move.

The steps, each logged:

1. **Wait** until gossip shows a model this node can fetch (:func:`.mesh_models.most_needed`).
2. **Manifest**: ask the nodes announcing it for its manifest and metadata, verified against
   the fingerprint, and open the local copy (:class:`meshnode.artifacts.store.PartialModel`),
   resuming what an earlier run verified. What it holds is offered to other joiners at once.
3. **Claim**: choose the range within the budget (:mod:`.memory_budget`): by time
   (:func:`.time_balance.choose_range_by_time`) where this node knows its own speed and every
   node on the route announces one (:mod:`.speed_inputs`), else by memory
   (:func:`meshnode.mesh.placement.choose_range`). By time, a node that knows no speed of its
   own first times a one-layer slice (``probe``, meshnode.app.speed_probe), fetched like a
   range. Announce the range as a claim, and wait ``claim_settle_s`` (a few gossip rounds) for
   the claims of nodes joining at the same moment; of two claims on one gap the lower node id
   keeps it, and the other chooses again.
4. **Fetch** exactly the tensors the range needs, from every node that holds them.
5. **Serve** through ``start_serving`` (the shard service and the API, built by the caller).
6. **Watch**: every ``poll_s``, ask :class:`.time_balance.TimeReplacement` (speeds known) or
   :class:`meshnode.mesh.placement.Replacement` (not) whether another range would make the best
   route faster by ``move_min_gain`` or cover layers nobody serves, for long enough; only then
   fetch the new range's tensors (still serving the old), drain, claim the new range and go
   back to step 4 (its fetch then finds them on disk). The settle time is stretched by a share
   of the node id, so two nodes that see the same gap do not both move at once.
7. **Yield when slow**: placing by time, a node whose own stage is found slow (``is_slow``: the
   verdict of :class:`meshnode.mesh.slow_stage.SlowStageWatch`) gives up the layers faster
   replicas serve, through the same move (:class:`.slow_yield.SlowYield`, the same settle time),
   and says so in its log and status; ``slow_yield`` off (``--no-slow-yield``) keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engines.gguf_file import read_gguf
from engines.slicing import tensors_for_range
from meshnode.artifacts.disk_room import check_disk_room
from meshnode.artifacts.fetcher import OpenLink, Quarantine, TransferError, fetch_manifest, fetch_tensors
from meshnode.artifacts.holdings import Holdings, PartialHolding
from meshnode.artifacts.progress import ProgressDisplay, TransferProgress
from meshnode.artifacts.store import ArtifactStore, PartialModel, StoreError
from meshnode.autoplace.config import PLACE_BY_MEMORY, PLACE_BY_TIME, AutoPlaceConfig
from meshnode.autoplace.layer_costs import LayerCosts, layer_costs
from meshnode.autoplace.memory_budget import read_machine_budget
from meshnode.autoplace.mesh_models import (
    MeshModel,
    ModelCoverage,
    claim_announcement,
    coverage,
    most_needed,
)
from meshnode.autoplace.slow_yield import SlowYield, YieldPlan
from meshnode.autoplace.speed_inputs import (
    OwnSpeed,
    announced_per_layer,
    estimated_speed,
    probe_layers,
    served_replicas,
    timed_others,
)
from meshnode.autoplace.time_balance import TimedRange, TimeReplacement, range_gaining_time
from meshnode.cancellation import cancel_and_wait
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.identity import short_id
from meshnode.logs import mib
from meshnode.mesh.placement import Claim, Range, Replacement, choose_range, claim_keeps
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# Placement gives up a failed step for this long before trying again (doubling, capped).
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0


class PlacingNode(Protocol):
    """What placement needs from :class:`meshnode.node.Node`."""

    @property
    def node_id(self) -> bytes: ...

    def peers(self) -> Iterable[Any]: ...  # PeerEntry: .peer_id, .announcement

    @property
    def evidence(self) -> EvidenceKeeper: ...

    async def get_link(self, peer_id: bytes) -> PeerLink: ...

    def set_serving(self, serving: mesh.ServedShard | None) -> None: ...

    def set_load(self, load: mesh.Load) -> None: ...


class Serving(Protocol):
    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class ServeRequest:
    """A range of a fetched model to serve: the file has the tensors of ``layers``, not all."""

    model_path: Path
    layers: Range
    fingerprint: str
    model_name: str


StartServing = Callable[[ServeRequest], Awaitable[Serving]]


@dataclass(frozen=True)
class _Move:
    layers: Range
    # Why, for the log line of the move.
    reason: str


class AutoShard:
    def __init__(
        self,
        node: PlacingNode,
        settings: AutoPlaceConfig,
        start_serving: StartServing,
        holdings: Holdings,
        *,
        budget: Callable[[], int | None] | None = None,
        open_link: OpenLink | None = None,
        own_speed: Callable[[], StageSpeed | None] | None = None,
        probe: Callable[[ServeRequest], Awaitable[StageSpeed | None]] | None = None,
        is_slow: Callable[[], bool] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._node = node
        # What artifact streams are opened on (the bulk lanes: TLS/TCP to a direct peer, else QUIC).
        self._open_link: OpenLink = open_link or node.get_link
        self._settings = settings
        self._start_serving = start_serving
        self._holdings = holdings
        self._store = ArtifactStore(settings.store_dir)
        self._store.lock()  # StoreInUse: another node on this store (the caller says so and stops)
        self._read_budget = budget or (
            lambda: read_machine_budget(settings.memory_budget, offload=settings.offload)
        )
        # Read once: once this node's layers are loaded, the memory they hold is no longer
        # "available", and a budget read again would shrink by them.
        self._budget_bytes: int | None = None
        self._state = "waiting for a model in gossip"
        self._model: MeshModel | None = None
        self._layers: Range | None = None
        self._progress: TransferProgress | None = None
        self._serving: Serving | None = None
        # Peers caught sending a wrong byte: never asked again by this node.
        self._quarantine = Quarantine()
        # Reply bytes received for tensors, all fetches together (what joining cost the network).
        self.fetched_bytes = 0
        # The id's first byte stretches the move settle time by up to half of it.
        self._move_settle_ns = round(settings.move_settle_s * SECOND_NS * (1 + node.node_id[0] / 510))
        # What the shard serving now announces of its speed (None: no shard, or none calibrated).
        self._read_own_speed = own_speed
        self._own_speed = OwnSpeed(settings.speed_estimate)
        # Loads a slice, reads the speed it calibrates, closes it (meshnode.app.speed_probe).
        self._probe = probe
        # What the last choice went by: time (a range taken for its speed) or memory (speeds
        # unknown, or none gaining enough); and what a serving node's moves go by now.
        self._placed_by: str | None = None
        self._moves_by: str | None = None
        # Whether this node's stage is found slow now (None: never); what its moves are timed by
        # (monotonic ns, a test's own).
        self._is_slow = is_slow
        self._clock = clock
        # The yield rule of the range served now, and the last yield made.
        self._slow_yield: SlowYield | None = None
        self._last_yield: YieldPlan | None = None

    # -- what `meshnode status` shows -------------------------------------------------

    def status(self) -> dict[str, Any]:
        report: dict[str, Any] = {"state": self._state}
        if self._model is not None:
            report["model"] = {"name": self._model.name, "fingerprint": self._model.fingerprint}
        if self._layers is not None:
            report["layers"] = list(self._layers)
        if self._progress is not None:
            report["transfer"] = self._progress.as_status()
        report["fetched_bytes"] = self.fetched_bytes
        report["place_by"] = self._settings.place_by
        if self._placed_by is not None:
            report["placed_by"] = self._placed_by
        if self._moves_by is not None:
            report["moves_by"] = self._moves_by
        own = self._own_speed.us_per_layer(())
        report["own_speed"] = {
            "source": self._own_speed.source,
            **({} if own is None else {"decode_ms_per_layer": round(own / 1_000, 3)}),
            **({} if self._settings.speed_estimate is None else {"estimate": self._settings.speed_estimate}),
        }
        report["slow_yield"] = self._slow_yield_status()
        return report

    def _slow_yield_status(self) -> dict[str, Any]:
        """Whether this node gives up layers when found slow, the yield waiting to last, the last made."""
        report: dict[str, Any] = {"enabled": self._settings.slow_yield, "slow": self._slow_now()}
        watching = self._slow_yield
        if watching is not None and watching.pending is not None and watching.pending_since_ns is not None:
            report["pending"] = {
                **watching.pending.to_json(),
                "pending_s": round((self._clock() - watching.pending_since_ns) / SECOND_NS, 1),
                "settle_s": round(watching.settle_ns / SECOND_NS, 1),
            }
        if self._last_yield is not None:
            report["last"] = {**self._last_yield.to_json(), "reason": self._last_yield.describe()}
        return report

    def _slow_now(self) -> bool:
        return self._is_slow is not None and self._is_slow()

    @property
    def serving(self) -> Serving | None:
        """What serves the placed range now (None while waiting, claiming, fetching or moving)."""
        return self._serving

    @property
    def layers(self) -> Range | None:
        """The range claimed or served, once chosen."""
        return self._layers

    # -- the steps ---------------------------------------------------------------------

    async def run(self) -> None:
        """Place, serve and watch until cancelled; a failed step is logged and tried again."""
        retry_s = _RETRY_FIRST_S
        while True:
            try:
                await self._place_and_serve()
                return
            except (TransferError, PlacementError, StoreError, OSError, ValueError) as exc:
                log.warning("placement: %s; trying again in %.0f s", exc, retry_s)
                self._state = f"retrying: {exc}"
                await self._let_go()
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, _RETRY_MAX_S)

    async def _place_and_serve(self) -> None:
        found = await self._wait_for_model()
        model = found.model
        self._model = model
        self._state = "fetching the manifest"
        manifest, metadata = await fetch_manifest(
            self._open_link, model.fingerprint, found.sources, quarantine=self._quarantine
        )
        partial = self._store.open(manifest, metadata)
        self._holdings.add(PartialHolding(partial))
        header = read_gguf(partial.path)
        costs = layer_costs(
            model.total_layers,
            {tensor.name: tensor.nbytes for tensor in manifest.tensors},
            lambda start, end: tensors_for_range(header, start, end),
        )
        await self._probe_own_speed(model, partial, header)
        layers = await self._claim(model, costs)
        while True:
            await self._fetch(partial, layers, header)
            self._state = "loading"
            self._serving = await self._start_serving(
                ServeRequest(partial.path, layers, model.fingerprint, model.name)
            )
            self._state = "serving"
            log.info("serving %s layers [%d, %d) placed by the mesh", model.name, *layers)
            move = await self._watch(model, costs, layers)
            log.info("moving from layers [%d, %d) to [%d, %d): %s", *layers, *move.layers, move.reason)
            # Fetched while the old range still serves: what routes lose while this node moves
            # (layers only it serves have no server until it is back) is a claim's wait and a
            # load, not a transfer of the new layers as well.
            await self._fetch(partial, move.layers, header)
            self._state = "moving"
            await self._let_go(drain=True)
            layers = await self._claim(model, costs, preferred=move.layers)

    async def _wait_for_model(self) -> ModelCoverage:
        announced = False
        while True:
            found = most_needed(self._announcements(), exclude=self._node.node_id)
            if found is not None and found.sources:
                log.info(
                    "the mesh serves %s (%d layers, fingerprint %s…) on %d node(s)",
                    found.model.name,
                    found.model.total_layers,
                    found.model.fingerprint[:12],
                    len(found.sources),
                )
                return found
            if not announced:
                log.info(
                    "no model in the mesh yet; this node serves layers once one is announced "
                    "(to serve a model file of this machine, start it with --model PATH)"
                )
                announced = True
            await asyncio.sleep(self._settings.poll_s)

    def _budget(self) -> int | None:
        if self._budget_bytes is None:
            self._budget_bytes = self._read_budget()
        return self._budget_bytes

    def _announcements(self) -> list[tuple[bytes, mesh.PeerAnnouncement]]:
        # A member quarantined on audit evidence (the admin's mesh policy) counts for nothing here:
        # neither its claims nor the layers it serves, so others cover them.
        quarantined = self._node.evidence.quarantined()
        return [(e.peer_id, e.announcement) for e in self._node.peers() if e.peer_id not in quarantined]

    def _choose(self, model: MeshModel, costs: LayerCosts) -> Range:
        budget = self._budget()
        if budget is None:
            raise PlacementError("cannot tell this machine's free memory; say --memory-budget")
        found = coverage(self._announcements(), model, exclude=self._node.node_id)
        # The claims that keep their range against this node's (claim_keeps: the faster, else the
        # lower node id) count as served; the others yield to it.
        keeps = self._claim_keeps(model)
        timed = self._timed(model, found, [c.node_id for c in found.claims if keeps(c)])
        layers = None
        if timed is not None:
            layers = range_gaining_time(
                model.total_layers,
                list(costs.per_layer),
                max(0, budget - costs.shared),
                *timed,
                min_gain=self._settings.join_min_gain,
            )
        self._placed_by = PLACE_BY_MEMORY if layers is None else PLACE_BY_TIME
        if layers is None:
            layers = choose_range(
                model.total_layers,
                list(costs.per_layer),
                max(0, budget - costs.shared),
                found.served_ranges,
                found.claims,
                self._node.node_id,
                keeps,
            )
        if layers is None:
            cheapest = min(costs.per_layer) + costs.shared
            raise PlacementError(
                f"a budget of {mib(budget)} holds no layer of {model.name} (the cheapest needs "
                f"{mib(cheapest)}); raise --memory-budget or free memory"
            )
        return layers

    def _timed(
        self, model: MeshModel, found: ModelCoverage, claims_of: Iterable[bytes] | None
    ) -> tuple[list[TimedRange], float] | None:
        """The other nodes' ranges (served, and the claims of ``claims_of``; all when None) with
        their per-layer times, and this node's; None where placement goes by memory: so set, or
        a speed unknown."""
        if self._settings.place_by != PLACE_BY_TIME:
            return None
        per_layer = announced_per_layer(self._announcements(), model)
        per_layer.pop(self._node.node_id, None)
        others = timed_others(found, per_layer, claims_of=claims_of)
        own = self._own_us_per_layer(model)
        return None if others is None or own is None else (others, own)

    def _own_us_per_layer(self, model: MeshModel) -> float | None:
        measured = announced_per_layer(self._announcements(), model, measured_only=True)
        measured.pop(self._node.node_id, None)
        return self._own_speed.us_per_layer(measured.values())

    async def _claim(self, model: MeshModel, costs: LayerCosts, preferred: Range | None = None) -> Range:
        """Announce a claim and keep it once it has stood ``claim_settle_s`` uncontested."""
        layers = preferred or self._choose(model, costs)
        while True:
            self._layers = layers
            self._state = "claiming"
            served, load = claim_announcement(model, layers, self._claim_speed(model, layers))
            self._node.set_serving(served)
            self._node.set_load(load)
            log.info(
                "claiming layers [%d, %d) of %s (%s); waiting %.0f s for other claims",
                *layers,
                model.name,
                mib(costs.range_bytes(*layers)),
                self._settings.claim_settle_s,
            )
            await asyncio.sleep(self._settings.claim_settle_s)
            settled = self._choose(model, costs)
            if settled == layers or (preferred is not None and not self._contested(model, layers)):
                return layers
            log.info("layers [%d, %d) were claimed by a node that keeps them; choosing again", *layers)
            layers, preferred = settled, None

    async def _probe_own_speed(self, model: MeshModel, partial: PartialModel, header: Any) -> None:
        """Before a first claim by time, with no speed of its own (none measured, none stated) and
        peers that measured theirs: time a one-layer slice (:func:`.speed_inputs.probe_layers`)."""
        if (
            self._probe is None
            or self._settings.place_by != PLACE_BY_TIME
            or self._own_us_per_layer(model) is not None
            or not announced_per_layer(self._announcements(), model, measured_only=True)
        ):
            return
        layers = probe_layers(model.total_layers)
        await self._fetch(partial, layers, header)
        self._state = "measuring this machine's speed"
        speed = await self._probe(ServeRequest(partial.path, layers, model.fingerprint, model.name))
        self._own_speed.probed(speed, layers)
        if speed is None:
            log.info("no speed from the probe of layers [%d, %d): placing by memory", *layers)
        else:
            log.info(
                "this machine decodes layers [%d, %d) in %.2f ms a token: placing by time",
                *layers,
                speed.decode_us_per_token / 1_000,
            )

    def _claim_speed(self, model: MeshModel, layers: Range) -> mesh.StageSpeed | None:
        """What a claim of ``layers`` announces of this node's speed (None: it knows none)."""
        own = self._own_us_per_layer(model)
        return None if own is None else estimated_speed(own, layers)

    def _contested(self, model: MeshModel, layers: Range) -> bool:
        """Whether a claim that keeps its range against this node's overlaps ``layers``."""
        found = coverage(self._announcements(), model, exclude=self._node.node_id)
        keeps = self._claim_keeps(model)
        return any(
            keeps(claim) and claim.layers[0] < layers[1] and layers[0] < claim.layers[1]
            for claim in found.claims
        )

    def _claim_keeps(self, model: MeshModel) -> Callable[[Claim], bool]:
        """Whether another node's claim keeps its range against this node's (claim_keeps): by
        the speeds the two claims say, when this node places by time and knows its own."""
        own_id = self._node.node_id
        own = self._own_us_per_layer(model) if self._settings.place_by == PLACE_BY_TIME else None
        theirs = announced_per_layer(self._announcements(), model) if own is not None else {}
        return lambda claim: claim_keeps(claim.node_id, theirs.get(claim.node_id), own_id, own)

    async def _fetch(self, partial: PartialModel, layers: Range, header: Any) -> None:
        assert self._model is not None
        wanted = tensors_for_range(header, *layers)
        if not partial.missing(wanted):
            log.info("layers [%d, %d): every tensor is already verified on disk", *layers)
            return
        missing_bytes = sum(
            partial.manifest.tensors[partial.index_of(name)].nbytes for name in partial.missing(wanted)
        )
        check_disk_room(self._store.store_dir, missing_bytes, what=f"layers [{layers[0]}, {layers[1]})")
        self._state = "fetching"
        sources = coverage(self._announcements(), self._model, exclude=self._node.node_id).sources
        progress = TransferProgress(f"layers {layers[0]}:{layers[1]}")
        self._progress = progress
        display = asyncio.ensure_future(ProgressDisplay(progress).run())
        try:
            report = await fetch_tensors(
                self._open_link, partial, wanted, sources, progress=progress, quarantine=self._quarantine
            )
        finally:
            progress.finish()
            await cancel_and_wait(display)
        self.fetched_bytes += report.bytes_received
        log.info(
            "fetched layers [%d, %d): %d tensor(s), %s from %s%s",
            *layers,
            len(report.fetched),
            mib(report.bytes_received),
            describe_sources(report.bytes_by_source),
            f"; quarantined {describe_sources(report.quarantined)}" if report.quarantined else "",
        )

    async def _watch(self, model: MeshModel, costs: LayerCosts, layers: Range) -> _Move:
        replacement = Replacement(
            min_gain_layers=self._settings.min_gain_layers, settle_ns=self._move_settle_ns
        )
        timed_replacement = self._time_replacement()
        self._slow_yield = self._new_slow_yield()
        while True:
            await asyncio.sleep(self._settings.poll_s)
            if self._read_own_speed is not None:
                self._own_speed.observe(self._read_own_speed(), layers)
            budget = self._budget()
            if budget is None:
                continue
            found = coverage(self._announcements(), model, exclude=self._node.node_id)
            timed = self._timed(model, found, None)
            moves_by = PLACE_BY_MEMORY if timed is None else PLACE_BY_TIME
            if moves_by != self._moves_by:
                # A better range seen by the other rule does not count toward this one's settle time.
                replacement = Replacement(
                    min_gain_layers=self._settings.min_gain_layers, settle_ns=self._move_settle_ns
                )
                timed_replacement = self._time_replacement()
                self._slow_yield = self._new_slow_yield()
                self._moves_by = moves_by
            now_ns = self._clock()
            if timed is None:
                moved_to = replacement.consider(
                    layers,
                    model.total_layers,
                    list(costs.per_layer),
                    max(0, budget - costs.shared),
                    [*found.served_ranges, *(claim.layers for claim in found.claims)],
                    now_ns,
                )
                if moved_to is not None:
                    return _Move(moved_to, "they cover layers nobody serves")
                continue
            moved_to = timed_replacement.consider(
                layers,
                model.total_layers,
                list(costs.per_layer),
                max(0, budget - costs.shared),
                *timed,
                now_ns,
            )
            if moved_to is not None:
                return _Move(
                    moved_to, "the mesh's best route is faster that way, or they cover layers nobody serves"
                )
            given_up = self._slow_yield.consider(
                self._settings.slow_yield and self._slow_now(),
                layers,
                model.total_layers,
                list(costs.per_layer),
                max(0, budget - costs.shared),
                served_replicas(found, announced_per_layer(self._announcements(), model)),
                *timed,
                now_ns,
            )
            if given_up is not None:
                self._last_yield = given_up
                log.warning(
                    "this node's stage slows every route through it: giving up layers to faster replicas: %s",
                    given_up.describe(),
                )
                return _Move(given_up.target, "giving up layers faster replicas serve")

    def _new_slow_yield(self) -> SlowYield:
        return SlowYield(join_min_gain=self._settings.join_min_gain, settle_ns=self._move_settle_ns)

    def _time_replacement(self) -> TimeReplacement:
        return TimeReplacement(
            min_gain=self._settings.move_min_gain,
            min_gain_layers=self._settings.min_gain_layers,
            settle_ns=self._move_settle_ns,
        )

    async def _let_go(self, *, drain: bool = False) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            if drain:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(serving.drain(), self._settings.move_drain_s)
            await serving.aclose()
        self._node.set_serving(None)

    async def aclose(self) -> None:
        try:
            await self._let_go()
        finally:
            self._store.unlock()


class PlacementError(Exception):
    """This node cannot place itself now; the message says why and what to change."""


def describe_sources(sources: Iterable[bytes]) -> str:
    return ", ".join(short_id(source) for source in sources)


__all__ = ["AutoPlaceConfig", "AutoShard", "PlacementError", "ServeRequest", "Serving", "StartServing"]
