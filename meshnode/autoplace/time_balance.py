"""Placement by time: the range that makes the mesh's best route fastest, from announced speeds. Pure.

Memory-only placement (:mod:`meshnode.mesh.placement`) takes as many layers as a node's budget
holds, as if every node computed alike. A pipeline runs at the pace of its slowest stage once
several sessions share it, so a node three times slower than the others should hold about a
third of the layers they hold, and a fast one more. Here every node is priced in decode
microseconds per token *per layer*: a peer's is the decode time it announces for its range
(``ServedShard.speed``) over the layers it serves, the joiner's its own estimate.

The route the head would run is modelled as it plans it (:mod:`meshnode.head.planner`): a
chain of hops covering ``[0, n_layers)`` in order, each running from where the previous one
ended (its ``effective_start_layer``) to the end of its own range, its stage costing its
per-layer time times the layers it runs. The *best route* is the chain whose slowest stage is
fastest, and a joiner takes, of the windows its budget holds, the one that makes that slowest
stage fastest; of equal ones the shortest (a slow node takes no layers it would not run), then
the lowest start. Where no window gains ``min_gain`` of the slowest stage's time, or any node
involved announces no speed, placement is memory-only, exactly as before.

A node at least :data:`~meshnode.mesh.slow_stage.SLOW_RATIO` times slower a layer than the one
choosing is modelled as giving up the end of its range (either end) that this node's window
takes over: that is what it does once faster replicas serve those layers
(:mod:`meshnode.autoplace.slow_yield`), keeping only the rest. Without that, a slow node holding the middle of the model kept
everyone's best route through all of its layers whatever a faster node took, so no faster node
moved, and it could not give up layers nobody else served: each waited for the other
(bench/heterogeneous.py, the slowed node joining first).

:class:`TimeReplacement` moves a serving node the same way, with the hysteresis of
:class:`~meshnode.mesh.placement.Replacement`: only to a range that stays better by
``min_gain`` for ``settle_ns``. Each move it allows makes the slowest stage of the best route
faster by that share, while speeds stay as they are, so moves cannot go round in a circle; a
speed that changes only for a while (a neighbour's burst of work) moves nobody.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.mesh.placement import (
    LastingChoice,
    Range,
    affordable_layers,
    best_range,
    replica_counts,
    uncovered,
)
from meshnode.mesh.slow_stage import SLOW_RATIO

# The share of the slowest stage's time a range must save to be taken for its speed (by a
# joiner) or moved to (by a serving node, and then only if it lasts): a small difference in
# announced speeds is noise (a smoothed figure moves a few per cent under load).
DEFAULT_MIN_GAIN = 0.1

_NO_ROUTE = math.inf


@dataclass(frozen=True)
class TimedRange:
    """A range a node serves or claims, and what each of its layers costs it per token."""

    layers: Range
    us_per_layer: float


def us_per_layer(decode_us_per_token: float, layers: Range) -> float:
    """The per-layer decode time of a node that announces ``decode_us_per_token`` for ``layers``."""
    start, end = layers
    if end <= start or decode_us_per_token <= 0:
        raise ValueError(f"a decode time of {decode_us_per_token} us for layers [{start}, {end})")
    return decode_us_per_token / (end - start)


def _forward(n_layers: int, stages: Sequence[TimedRange]) -> list[float]:
    """``reach[e]``: the slowest stage of the best chain covering ``[0, e)`` whose last hop ends
    at ``e`` (infinite where none does)."""
    reach = [_NO_ROUTE] * (n_layers + 1)
    reach[0] = 0.0
    ending: dict[int, list[TimedRange]] = {}
    for stage in stages:
        ending.setdefault(stage.layers[1], []).append(stage)
    for end in range(1, n_layers + 1):
        for stage in ending.get(end, ()):
            for start in range(max(0, stage.layers[0]), end):
                if reach[start] < _NO_ROUTE:
                    reach[end] = min(reach[end], max(reach[start], (end - start) * stage.us_per_layer))
    return reach


def _backward(n_layers: int, stages: Sequence[TimedRange]) -> list[float]:
    """``rest[s]``: the slowest stage of the best chain covering ``[s, n_layers)`` whose first hop
    starts at ``s`` (infinite where none can)."""
    rest = [_NO_ROUTE] * (n_layers + 1)
    rest[n_layers] = 0.0
    for start in range(n_layers - 1, -1, -1):
        for stage in stages:
            first, end = stage.layers
            if first <= start < end <= n_layers and rest[end] < _NO_ROUTE:
                rest[start] = min(rest[start], max(rest[end], (end - start) * stage.us_per_layer))
    return rest


def _yield_windows(
    n_layers: int, others: Sequence[TimedRange], own_us_per_layer: float, longest: Sequence[int]
) -> list[tuple[Range, float]]:
    """The windows that take over one end of a node at least ``SLOW_RATIO`` times slower a layer
    than this one, each with the slowest stage of the best route once that node kept only the
    rest of its range (:mod:`meshnode.autoplace.slow_yield` drops from its range's ends the layers
    faster nodes serve; a layer in its middle it keeps)."""
    found = []
    for index, stage in enumerate(others):
        if stage.us_per_layer < SLOW_RATIO * own_us_per_layer:
            continue
        first, end = stage.layers
        rest = [*others[:index], *others[index + 1 :]]
        # This node takes [start, stop) with the slow node's tail: it keeps [first, start).
        for start in range(first + 1, end):
            for stop in range(end, min(n_layers, start + longest[start]) + 1):
                kept = TimedRange((first, start), stage.us_per_layer)
                mine = TimedRange((start, stop), own_us_per_layer)
                found.append(((start, stop), route_bottleneck(n_layers, [*rest, kept, mine])))
        # Or with its head: it keeps [stop, end).
        for stop in range(first + 1, end):
            for start in range(0, first + 1):
                if stop - start > longest[start]:
                    continue
                kept = TimedRange((stop, end), stage.us_per_layer)
                mine = TimedRange((start, stop), own_us_per_layer)
                found.append(((start, stop), route_bottleneck(n_layers, [*rest, kept, mine])))
    return found


def route_bottleneck(n_layers: int, stages: Sequence[TimedRange]) -> float:
    """The slowest stage (us per token) of the best route over ``stages``; infinite when they
    leave a layer uncovered."""
    return _forward(n_layers, stages)[n_layers]


@dataclass(frozen=True)
class TimeChoice:
    layers: Range
    # The slowest stage of the best route with this range taken, and without this node.
    bottleneck_us: float
    without_us: float

    @property
    def gain(self) -> float:
        """The share of the slowest stage's time this range saves (1.0 where there was no route)."""
        if self.without_us == _NO_ROUTE:
            return 1.0 if self.bottleneck_us < _NO_ROUTE else 0.0
        return 1.0 - self.bottleneck_us / self.without_us if self.without_us > 0 else 0.0


def fastest_range(
    n_layers: int,
    layer_bytes: Sequence[int],
    budget_bytes: int,
    others: Sequence[TimedRange],
    own_us_per_layer: float,
) -> TimeChoice | None:
    """Of the windows ``budget_bytes`` holds, the one whose best route (``others`` and this node on
    it) has the fastest slowest stage; of equal ones the shortest, then the lowest start. None
    when no window gives a route (layers nobody covers that one window cannot close).

    With ``reach`` and ``rest`` computed once from ``others``, a window ``[a, b)`` of this node
    is worth ``min over s in [a, b) of max(reach[s], (b - s) * t, rest[b])``: the chain before it
    ends where this node starts running, the chain after it starts where it ends. Nodes much
    slower than this one may give up the end of their range this node takes (:func:`_yield_windows`)."""
    if len(layer_bytes) != n_layers:
        raise ValueError(f"{len(layer_bytes)} layer sizes for {n_layers} layers")
    if own_us_per_layer <= 0:
        raise ValueError(f"a per-layer time of {own_us_per_layer} us")
    reach, rest = _forward(n_layers, others), _backward(n_layers, others)
    without = reach[n_layers]
    longest = [affordable_layers(layer_bytes, start, budget_bytes) for start in range(n_layers)]
    best: tuple[tuple[float, int, int], TimeChoice] | None = None
    for end in range(1, n_layers + 1):
        if rest[end] == _NO_ROUTE:
            continue
        running = _NO_ROUTE  # min over s in [start, end) of max(reach[s], (end - s) * t)
        for start in range(end - 1, -1, -1):
            running = min(running, max(reach[start], (end - start) * own_us_per_layer))
            if end - start > longest[start]:
                continue
            value = min(without, max(running, rest[end]))
            if value == _NO_ROUTE:
                continue
            # Rounded so that float noise in equal sums never decides between equal windows.
            key = (round(value, 6), end - start, start)
            if best is None or key < best[0]:
                best = (key, TimeChoice((start, end), value, without))
    for layers, value in _yield_windows(n_layers, others, own_us_per_layer, longest):
        if value == _NO_ROUTE:
            continue
        key = (round(value, 6), layers[1] - layers[0], layers[0])
        if best is None or key < best[0]:
            best = (key, TimeChoice(layers, value, without))
    return None if best is None else best[1]


def choose_range_by_time(
    n_layers: int,
    layer_bytes: Sequence[int],
    budget_bytes: int,
    others: Sequence[TimedRange],
    own_us_per_layer: float,
    *,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> Range | None:
    """The range a joiner with ``own_us_per_layer`` takes, ``others`` being what the mesh serves
    and the claims that keep their range against it (those of lower node ids, as in
    :func:`~meshnode.mesh.placement.choose_range`): the fastest window where it gains
    ``min_gain``, else the memory-only choice (layers nobody serves, then where replicas are
    fewest, as many as the budget holds); None when the budget holds no layer."""
    gaining = range_gaining_time(
        n_layers, layer_bytes, budget_bytes, others, own_us_per_layer, min_gain=min_gain
    )
    if gaining is not None:
        return gaining
    counts = replica_counts(n_layers, [other.layers for other in others])
    return best_range(counts, layer_bytes, budget_bytes)


def range_gaining_time(
    n_layers: int,
    layer_bytes: Sequence[int],
    budget_bytes: int,
    others: Sequence[TimedRange],
    own_us_per_layer: float,
    *,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> Range | None:
    """:func:`fastest_range`'s window where it saves ``min_gain`` of the slowest stage's time;
    None where memory-only placement decides."""
    found = fastest_range(n_layers, layer_bytes, budget_bytes, others, own_us_per_layer)
    return found.layers if found is not None and found.gain >= min_gain else None


class TimeReplacement:
    """Whether a serving node should move, by time and by coverage, only for a lasting gain."""

    def __init__(
        self,
        *,
        min_gain: float = DEFAULT_MIN_GAIN,
        min_gain_layers: int = 1,
        settle_ns: int = 60_000_000_000,
    ) -> None:
        if not 0 < min_gain < 1 or min_gain_layers < 1 or settle_ns < 0:
            raise ValueError("a move needs a gain within (0, 1), a positive layer gain, a settle time")
        self.min_gain = min_gain
        self.min_gain_layers = min_gain_layers
        self.settle_ns = settle_ns
        self._lasting = LastingChoice(settle_ns)

    def target(
        self,
        current: Range,
        n_layers: int,
        layer_bytes: Sequence[int],
        budget_bytes: int,
        others: Sequence[TimedRange],
        own_us_per_layer: float,
    ) -> Range | None:
        """The range that is better now (no waiting): faster by ``min_gain``, else covering at
        least ``min_gain_layers`` more layers nobody else serves; None when ``current`` is as good."""
        found = fastest_range(n_layers, layer_bytes, budget_bytes, others, own_us_per_layer)
        if found is not None and found.layers != current:
            now = route_bottleneck(n_layers, [*others, TimedRange(current, own_us_per_layer)])
            if now == _NO_ROUTE or found.bottleneck_us <= now * (1 - self.min_gain):
                return found.layers
        counts = replica_counts(n_layers, [other.layers for other in others])
        best = best_range(counts, layer_bytes, budget_bytes)
        if best is None or best == current:
            return None
        return best if uncovered(counts, best) - uncovered(counts, current) >= self.min_gain_layers else None

    def consider(
        self,
        current: Range,
        n_layers: int,
        layer_bytes: Sequence[int],
        budget_bytes: int,
        others: Sequence[TimedRange],
        own_us_per_layer: float,
        now_ns: int,
    ) -> Range | None:
        """The range to move to now, or None to stay: a better range must stay the same better
        range for ``settle_ns``. ``others``: the rest of the mesh (this node left out)."""
        best = self.target(current, n_layers, layer_bytes, budget_bytes, others, own_us_per_layer)
        return self._lasting.settled(best, now_ns)


__all__ = [
    "DEFAULT_MIN_GAIN",
    "TimeChoice",
    "TimeReplacement",
    "TimedRange",
    "choose_range_by_time",
    "fastest_range",
    "range_gaining_time",
    "route_bottleneck",
    "us_per_layer",
]
