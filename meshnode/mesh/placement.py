"""Which contiguous layer range a node should serve, from what the mesh already covers (issue 16).

A node that joins with no ``--layers`` takes the range that helps most: layers nobody
serves first, then the least-replicated ones, as many as its memory budget holds.
Before it loads, it announces its choice as a claim; of two nodes joining at the same
moment, one keeps a contested range and the other counts that claim as served, so they end
on different ranges: the faster, where both claims say their speed and one is faster by
more than :data:`CLAIM_SPEED_MARGIN` (a slow machine that happened to choose first must not
keep the range a faster one wanted: no later move can undo that when the two ranges only
work together), else the lower node id (:func:`claim_keeps`). Once serving, a node moves only
when another range would cover at least ``min_gain_layers`` more uncovered layers and
that stays true for ``settle_ns`` (:class:`Replacement`): a gap that closes by itself, or
coverage that flickers while nodes come and go, moves nobody (the oscillation Petals'
rebalancing is known for).

Pure: coverage comes in as ranges, time as ``now_ns``; :mod:`meshnode.autoplace.auto_shard` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Range = tuple[int, int]


@dataclass(frozen=True)
class Claim:
    """A range a node announced it is about to load (or serves)."""

    node_id: bytes
    layers: Range


def replica_counts(n_layers: int, served: Sequence[Range]) -> list[int]:
    """How many of ``served`` cover each layer."""
    counts = [0] * n_layers
    for start, end in served:
        for layer in range(max(0, start), min(n_layers, end)):
            counts[layer] += 1
    return counts


def _score(counts: Sequence[int], start: int, end: int) -> tuple[int, int, int]:
    """Higher is better: uncovered layers taken, then layers taken (the budget used: the rest add
    replicas where they are fewest), then fewer replicas over the range."""
    window = counts[start:end]
    return sum(1 for c in window if c == 0), end - start, -sum(window)


def affordable_layers(layer_bytes: Sequence[int], start: int, budget_bytes: int) -> int:
    """How many layers from ``start`` fit in ``budget_bytes`` (0 when not even one)."""
    total, count = 0, 0
    for size in layer_bytes[start:]:
        if total + size > budget_bytes:
            break
        total += size
        count += 1
    return count


def best_range(counts: Sequence[int], layer_bytes: Sequence[int], budget_bytes: int) -> Range | None:
    """The affordable window with the best score; ties go to the lowest start."""
    best: tuple[tuple[int, int, int], Range] | None = None
    for start in range(len(counts)):
        length = affordable_layers(layer_bytes, start, budget_bytes)
        if length == 0:
            continue
        candidate = (_score(counts, start, start + length), (start, start + length))
        if best is None or candidate[0] > best[0]:
            best = candidate
    return None if best is None else best[1]


# How much faster per layer one claimer must say it is for its claim to keep a contested range
# against a lower node id's: a margin, so that two estimates of alike machines (each side reads
# the other's from its signed claim, rounded) never make both sides keep, or both yield.
CLAIM_SPEED_MARGIN = 0.25


def claim_keeps(
    claimer: bytes, claimer_us_per_layer: float | None, other: bytes, other_us_per_layer: float | None
) -> bool:
    """Whether ``claimer``'s claim keeps its range against ``other``'s; both sides compute the
    same answer from the same two claims. Speeds are per-layer decode times (None: not said)."""
    if claimer_us_per_layer and other_us_per_layer:
        if claimer_us_per_layer * (1 + CLAIM_SPEED_MARGIN) < other_us_per_layer:
            return True
        if other_us_per_layer * (1 + CLAIM_SPEED_MARGIN) < claimer_us_per_layer:
            return False
    return claimer < other


def choose_range(
    n_layers: int,
    layer_bytes: Sequence[int],
    budget_bytes: int,
    served: Sequence[Range],
    claims: Sequence[Claim],
    node_id: bytes,
    keeps: Callable[[Claim], bool] | None = None,
) -> Range | None:
    """The range ``node_id`` should take, given the ranges served and the other nodes' claims;
    None when its budget holds no layer. Claims that keep their range against this node's
    (``keeps``; by default those of lower node ids) count as served; the others yield to this
    node, so simultaneous joiners never settle on the same gap."""
    if len(layer_bytes) != n_layers:
        raise ValueError(f"{len(layer_bytes)} layer sizes for {n_layers} layers")
    if keeps is None:
        keeps = lambda claim: claim.node_id < node_id  # noqa: E731
    taken = [*served, *(claim.layers for claim in claims if keeps(claim))]
    return best_range(replica_counts(n_layers, taken), layer_bytes, budget_bytes)


def uncovered(counts: Sequence[int], layers: Range) -> int:
    return sum(1 for layer in range(*layers) if counts[layer] == 0)


class LastingChoice:
    """Hysteresis of a move: the same better range must be seen for ``settle_ns`` in a row."""

    def __init__(self, settle_ns: int) -> None:
        self.settle_ns = settle_ns
        # The better range seen, and since when it has stayed better.
        self._candidate: Range | None = None
        self._since_ns = 0

    def settled(self, better: Range | None, now_ns: int) -> Range | None:
        """``better`` (None: nothing is better now) once it has lasted; None meanwhile."""
        if better is None:
            self._candidate = None
            return None
        if better != self._candidate:
            self._candidate, self._since_ns = better, now_ns
        if now_ns - self._since_ns < self.settle_ns:
            return None
        self._candidate = None
        return better


class Replacement:
    """Whether a serving node should move, with hysteresis: only for a large and lasting gain."""

    def __init__(self, *, min_gain_layers: int = 1, settle_ns: int = 60_000_000_000) -> None:
        if min_gain_layers < 1 or settle_ns < 0:
            raise ValueError("a move needs a positive gain and a non-negative settle time")
        self.min_gain_layers = min_gain_layers
        self.settle_ns = settle_ns
        self._lasting = LastingChoice(settle_ns)

    def consider(
        self,
        current: Range,
        n_layers: int,
        layer_bytes: Sequence[int],
        budget_bytes: int,
        others_served: Sequence[Range],
        now_ns: int,
    ) -> Range | None:
        """The range to move to now, or None to stay. ``others_served``: what the rest of the mesh
        serves (this node's own range left out)."""
        counts = replica_counts(n_layers, others_served)
        best = best_range(counts, layer_bytes, budget_bytes)
        gain = 0 if best is None else uncovered(counts, best) - uncovered(counts, current)
        better = None if best is None or best == current or gain < self.min_gain_layers else best
        return self._lasting.settled(better, now_ns)


__all__ = [
    "Claim",
    "LastingChoice",
    "Range",
    "Replacement",
    "affordable_layers",
    "best_range",
    "choose_range",
    "replica_counts",
    "uncovered",
]
