"""A serving node whose stage slows everyone down gives up the layers faster replicas serve. Pure.

:mod:`meshnode.mesh.slow_stage` says when this node's stage has taken far more time for its
layers than the others' for long enough (its verdict: at least twice the median for 60 s, cleared
under 1.5x for 60 s). :class:`.time_balance.TimeReplacement` moves a serving node only when
another range makes the best route 25 % faster, and a slow node holding layers that a faster node
also serves often makes no route slower at all (the planner routes around it), so nothing moves
it: it keeps the layers, and every route the planner spills onto it when the faster replica is
busy runs at its pace for all of them. This rule gives them up:

* a layer of its range is *served faster* when a node serving it now (a claim is not serving yet)
  announces a per-layer decode time faster than this node's by :data:`FASTER_MARGIN`;
* the new range is the hull of the layers no faster node serves: the layers served faster are
  dropped from the range's ends, never a layer only this node (or only slower nodes) serves, so no
  layer is left uncovered by the mesh gossip shows (a faster node that starts moving just as the
  yield is made leaves a gap for as long as its move takes, which the coverage rule of placement
  closes like any other). A node serves one contiguous range, so layers served faster between two
  it must keep stay with it;
* when a faster node serves every layer of its range, it goes where placement by time would put
  it as a joiner (:func:`.time_balance.range_gaining_time`: the shortest window that makes the
  best route faster by ``join_min_gain``), and stays where no window gains that. It does not
  shrink to nothing (a node serves at least one layer), nor re-place by memory, which would take
  as many layers as its budget holds, the very layers it gives up; staying, it is a spare replica
  the planner spills to;
* a target whose best route (:func:`.time_balance.route_bottleneck` over the mesh with it)
  would be slower than with the current range is no target.

The last point is what keeps this rule and :class:`.time_balance.TimeReplacement` from undoing
each other: a yield never makes the modelled best route slower, and a move by time needs it 25 %
faster, so placement by time never moves a node back to a range it gave up while the faster
replica serves it (each move by time makes the route faster, each yield shrinks the range or
leaves the route as fast, so moves cannot go round). :class:`SlowYield` adds the hysteresis of
the other moves (:class:`meshnode.mesh.placement.LastingChoice`): only a yield that stays the
same for ``settle_ns`` while the verdict stays slow is made; a slow spell shorter than that, or a
verdict that clears, moves nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshnode.autoplace.time_balance import TimedRange, range_gaining_time, route_bottleneck
from meshnode.identity import short_id
from meshnode.mesh.placement import LastingChoice, Range

# How much faster per layer a replica must announce itself than this node for its layers to be
# given up to it: the margin of the claims' speed comparison (mesh.placement.CLAIM_SPEED_MARGIN),
# so that the estimates of alike machines never count one as the other's faster replica.
FASTER_MARGIN = 0.25


@dataclass(frozen=True)
class Replica:
    """A range another node serves now, and what each of its layers costs it per token."""

    node_id: bytes
    layers: Range
    us_per_layer: float


@dataclass(frozen=True)
class YieldPlan:
    """Layers this node gives up to faster replicas: what it serves now, what it will serve."""

    current: Range
    target: Range
    # The layers of ``current`` outside ``target`` (one or two runs), and the faster nodes that
    # serve them.
    given_up: tuple[Range, ...]
    faster: tuple[bytes, ...]
    own_us_per_layer: float
    # The median per-layer time of the other nodes serving the model.
    median_us_per_layer: float
    # Every layer of ``current`` was served faster: ``target`` is placement by time's.
    moved: bool

    def describe(self) -> str:
        """``stage 3.00 ms/layer vs median 1.00; layers [3, 5) served faster by node ab12cd; now
        serving [5, 6)``."""
        runs = ", ".join(f"[{start}, {end})" for start, end in self.given_up)
        nodes = ", ".join(short_id(node_id) for node_id in self.faster)
        text = (
            f"stage {self.own_us_per_layer / 1_000:.2f} ms/layer vs median "
            f"{self.median_us_per_layer / 1_000:.2f}; layers {runs} served faster by node {nodes}; "
            f"now serving [{self.target[0]}, {self.target[1]})"
        )
        if self.moved:
            text += ", where placement by time puts it (a faster node serves every layer it held)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "from": list(self.current),
            "to": list(self.target),
            "given_up": [list(run) for run in self.given_up],
            "faster_nodes": [short_id(node_id) for node_id in self.faster],
            "stage_ms_per_layer": round(self.own_us_per_layer / 1_000, 3),
            "median_ms_per_layer": round(self.median_us_per_layer / 1_000, 3),
            "moved": self.moved,
        }


def is_faster(replica: Replica, own_us_per_layer: float) -> bool:
    return replica.us_per_layer * (1 + FASTER_MARGIN) < own_us_per_layer


def faster_servers(layer: int, replicas: Sequence[Replica], own_us_per_layer: float) -> list[bytes]:
    """The nodes serving ``layer`` faster than this node, by the margin."""
    return [
        replica.node_id
        for replica in replicas
        if replica.layers[0] <= layer < replica.layers[1] and is_faster(replica, own_us_per_layer)
    ]


def outside(current: Range, target: Range) -> tuple[Range, ...]:
    """The runs of ``current``'s layers that ``target`` leaves out."""
    runs = []
    if current[0] < min(target[0], current[1]):
        runs.append((current[0], min(target[0], current[1])))
    if max(target[1], current[0]) < current[1]:
        runs.append((max(target[1], current[0]), current[1]))
    return tuple(runs)


def yield_plan(
    current: Range,
    n_layers: int,
    layer_bytes: Sequence[int],
    budget_bytes: int,
    replicas: Sequence[Replica],
    others: Sequence[TimedRange],
    own_us_per_layer: float,
    *,
    join_min_gain: float,
) -> YieldPlan | None:
    """What a slow node serving ``current`` gives up now (no waiting), or None to keep its range.

    ``replicas``: the other nodes serving the model now, with their speeds; ``others``: what the
    best route is priced over (as :class:`.time_balance.TimeReplacement` is given it: the
    replicas and the claims of nodes about to serve)."""
    if own_us_per_layer <= 0:
        raise ValueError(f"a per-layer time of {own_us_per_layer} us")
    served_faster = {layer: faster_servers(layer, replicas, own_us_per_layer) for layer in range(*current)}
    kept = [layer for layer, nodes in served_faster.items() if not nodes]
    moved = not kept
    if moved:
        target = range_gaining_time(
            n_layers, layer_bytes, budget_bytes, others, own_us_per_layer, min_gain=join_min_gain
        )
    else:
        target = (kept[0], kept[-1] + 1)
    if target is None or target == current:
        return None
    # Never a range whose best route is slower than the current one's (rounded, as float sums of
    # equal stages differ in their last bits).
    before = route_bottleneck(n_layers, [*others, TimedRange(current, own_us_per_layer)])
    after = route_bottleneck(n_layers, [*others, TimedRange(target, own_us_per_layer)])
    if round(after, 6) > round(before, 6):
        return None
    given_up = outside(current, target)
    faster = sorted(
        {node for start, end in given_up for layer in range(start, end) for node in served_faster[layer]}
    )
    if not faster:
        # Layers dropped in a move that no faster node serves: a move by time, not a yield.
        return None
    median = statistics.median(replica.us_per_layer for replica in replicas)
    return YieldPlan(current, target, given_up, tuple(faster), own_us_per_layer, median, moved)


class SlowYield:
    """Whether a serving node gives up layers for being slow, with hysteresis: only a yield that
    stays the same for ``settle_ns`` while the node's stage stays slow."""

    def __init__(self, *, join_min_gain: float, settle_ns: int) -> None:
        if not 0 < join_min_gain < 1 or settle_ns < 0:
            raise ValueError("a yield needs a gain within (0, 1) and a non-negative settle time")
        self.join_min_gain = join_min_gain
        self.settle_ns = settle_ns
        self._lasting = LastingChoice(settle_ns)
        # The yield seen now, waiting to last (None: none), and since when (monotonic ns).
        self.pending: YieldPlan | None = None
        self.pending_since_ns: int | None = None

    def consider(
        self,
        slow: bool,
        current: Range,
        n_layers: int,
        layer_bytes: Sequence[int],
        budget_bytes: int,
        replicas: Sequence[Replica],
        others: Sequence[TimedRange],
        own_us_per_layer: float,
        now_ns: int,
    ) -> YieldPlan | None:
        """The yield to make now, or None to keep the range. ``slow``: this node's verdict
        (:meth:`meshnode.mesh.slow_stage.SlowStageWatch.is_slow`)."""
        plan = None
        if slow:
            plan = yield_plan(
                current,
                n_layers,
                layer_bytes,
                budget_bytes,
                replicas,
                others,
                own_us_per_layer,
                join_min_gain=self.join_min_gain,
            )
        if plan is None or self.pending is None or plan.target != self.pending.target:
            self.pending_since_ns = None if plan is None else now_ns
        self.pending = plan
        settled = self._lasting.settled(None if plan is None else plan.target, now_ns)
        if settled is None:
            return None
        self.pending, self.pending_since_ns = None, None
        return plan


__all__ = [
    "FASTER_MARGIN",
    "Replica",
    "SlowYield",
    "YieldPlan",
    "faster_servers",
    "is_faster",
    "outside",
    "yield_plan",
]
