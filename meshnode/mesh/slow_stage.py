"""Which stage slows every route through it: its time for the work it holds far above the others'. Pure.

A pipeline runs at the pace of its slowest stage, so one slow node holding a share of the
layers holds the whole mesh to its speed. Every serving node announces what a decode step of
its range takes (``ServedShard.speed``, signed by that node); divided by the work the range
holds, it gives a time per unit of work that stages of one model can be compared by. The work
is the range's layer count unless the caller knows better: on a model whose output projection
outweighs its layers (Gemma 3 270M), the weight bytes a decode step reads
(``meshnode.autoplace.stage_balance.StepCosts.stage``) keep the last stage from looking slow
for the vocabulary it computes.

A stage is *over* when its time per unit of work is at least ``slow_ratio`` times the median
of the other stages' of the same model (one other stage at least; replicas of one range count
as stages). :class:`SlowStageWatch` adds hysteresis over time: a stage becomes *slow* once it
has been over for ``lasting_ns`` without a break, and stops being slow once it has been under
``clear_ratio`` (below ``slow_ratio``, so a figure hovering at the threshold does not flap)
for ``lasting_ns``. A short-lived slowdown (a neighbour's burst, a page fault) makes no
verdict; the announced figures are smoothed already, this makes the verdict last.

Giving up layers is placement's decision: :meth:`SlowStageWatch.is_slow` is what it asks
(meshnode.autoplace.slow_yield, run by meshnode.autoplace.auto_shard).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from meshnode.identity import short_id
from meshnode.mesh.serving_states import ACCEPTING_STATES
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh

# A stage twice as slow per unit of work as the others' median is slow; it is cleared below 1.5x.
SLOW_RATIO = 2.0
CLEAR_RATIO = 1.5
# How long a stage must stay over (or under) before the verdict changes: longer than a burst,
# and a few dozen of the stage-speed EWMA's batches.
LASTING_NS = 60 * SECOND_NS

# Which stages compare: one model's, by its fingerprint digests and layer count.
ModelKey = tuple[str, str, int]
# The work a range holds, in a unit shared by every stage of the model: (model, start, end) -> work.
RangeWork = Callable[[ModelKey, int, int], float]


def layer_count(model: ModelKey, start: int, end: int) -> float:
    """The default work of a range: its layers."""
    return float(end - start)


@dataclass(frozen=True)
class StageFigure:
    node_id: bytes
    model: ModelKey
    start_layer: int
    end_layer: int
    decode_ms_per_token: float
    # What the range computes per token (RangeWork); above 0.
    work: float

    @property
    def ms_per_work(self) -> float:
        return self.decode_ms_per_token / self.work


@dataclass(frozen=True)
class StageRatio:
    """A stage's time per unit of work against the median of the other stages' of its model."""

    node_id: bytes
    ratio: float
    ms_per_work: float
    others_ms_per_work: float
    compared_with: int


def stage_figures(
    announcements: Iterable[tuple[bytes, mesh.PeerAnnouncement]], work: RangeWork = layer_count
) -> list[StageFigure]:
    """The stages that announce a speed and take sessions, from ``(node id, announcement)`` pairs."""
    figures = []
    for node_id, announcement in announcements:
        if not announcement.HasField("serving") or announcement.load.serving_state not in ACCEPTING_STATES:
            continue
        served = announcement.serving
        if not served.HasField("speed") or served.speed.decode_us_per_token <= 0:
            continue
        start, end = served.shard_range.start_layer, served.shard_range.end_layer
        if not 0 <= start < end <= served.total_layers:
            continue
        model = (
            served.fingerprint.model_artifact_digest,
            served.fingerprint.runtime_recipe_digest,
            served.total_layers,
        )
        amount = work(model, start, end)
        if amount <= 0:
            continue
        figures.append(
            StageFigure(node_id, model, start, end, served.speed.decode_us_per_token / 1_000, amount)
        )
    return figures


def stage_ratios(stages: Iterable[StageFigure]) -> dict[bytes, StageRatio]:
    """Each stage against the median of the others of its model (none for a model's only stage)."""
    by_model: dict[ModelKey, list[StageFigure]] = {}
    for stage in stages:
        by_model.setdefault(stage.model, []).append(stage)
    ratios: dict[bytes, StageRatio] = {}
    for group in by_model.values():
        for stage in group:
            others = [other.ms_per_work for other in group if other.node_id != stage.node_id]
            if not others:
                continue
            median = statistics.median(others)
            if median <= 0:
                continue
            ratios[stage.node_id] = StageRatio(
                stage.node_id, stage.ms_per_work / median, stage.ms_per_work, median, len(others)
            )
    return ratios


@dataclass(frozen=True)
class SlowVerdict:
    node_id: bytes
    slow: bool
    # The latest comparison.
    ratio: float
    compared_with: int
    # Since when (monotonic ns) the stage has been on the way to the other verdict: over the slow
    # ratio while not slow, or under the clearing ratio while slow; None: no change pending.
    pending_since_ns: int | None
    # When the verdict last changed (None: never slow).
    changed_at_ns: int | None

    def to_json(self, now_ns: int) -> dict[str, Any]:
        return {
            "node": short_id(self.node_id),
            "slow": self.slow,
            "ratio": round(self.ratio, 2),
            "compared_with": self.compared_with,
            "pending_s": None
            if self.pending_since_ns is None
            else round((now_ns - self.pending_since_ns) / SECOND_NS, 1),
            "since_s": None
            if self.changed_at_ns is None
            else round((now_ns - self.changed_at_ns) / SECOND_NS, 1),
        }


class SlowStageWatch:
    """The slow-stage verdicts over time, from the comparisons :meth:`observe` is given."""

    def __init__(
        self,
        *,
        slow_ratio: float = SLOW_RATIO,
        clear_ratio: float = CLEAR_RATIO,
        lasting_ns: int = LASTING_NS,
    ) -> None:
        if not 1.0 < clear_ratio <= slow_ratio:
            raise ValueError("the clearing ratio is above 1 and at most the slow ratio")
        self.slow_ratio = slow_ratio
        self.clear_ratio = clear_ratio
        self.lasting_ns = lasting_ns
        self._verdicts: dict[bytes, SlowVerdict] = {}

    def observe(self, now_ns: int, stages: Iterable[StageFigure]) -> list[SlowVerdict]:
        """Compare ``stages`` (the mesh as it is now) and return the verdicts that changed.

        A stage that is no longer compared (gone, not serving, its model's only stage) is
        forgotten: it slows no route now."""
        ratios = stage_ratios(stages)
        changed = []
        verdicts: dict[bytes, SlowVerdict] = {}
        for node_id, ratio in ratios.items():
            before = self._verdicts.get(node_id)
            verdict = self._next(before, ratio, now_ns)
            verdicts[node_id] = verdict
            if verdict.slow != (before.slow if before is not None else False):
                changed.append(verdict)
        self._verdicts = verdicts
        return changed

    def _next(self, before: SlowVerdict | None, ratio: StageRatio, now_ns: int) -> SlowVerdict:
        slow = before.slow if before is not None else False
        changed_at = before.changed_at_ns if before is not None else None
        # Over the threshold while not slow, or under the clearing one while slow: a change pending.
        toward_change = ratio.ratio < self.clear_ratio if slow else ratio.ratio >= self.slow_ratio
        pending = None
        if toward_change:
            pending = (
                before.pending_since_ns
                if before is not None and before.pending_since_ns is not None
                else now_ns
            )
            if now_ns - pending >= self.lasting_ns:
                slow, changed_at, pending = not slow, now_ns, None
        return SlowVerdict(ratio.node_id, slow, ratio.ratio, ratio.compared_with, pending, changed_at)

    def verdict(self, node_id: bytes) -> SlowVerdict | None:
        """The node's verdict at the last observation (None: its stage was not compared)."""
        return self._verdicts.get(node_id)

    def is_slow(self, node_id: bytes) -> bool:
        """Whether the node's stage has been slow for long enough to say so: what placement asks
        before moving layers off it."""
        verdict = self._verdicts.get(node_id)
        return verdict is not None and verdict.slow

    def compared_nodes(self) -> list[bytes]:
        """The nodes whose stage the last observation compared, in id order."""
        return sorted(self._verdicts)

    def slow_nodes(self) -> frozenset[bytes]:
        return frozenset(node_id for node_id, verdict in self._verdicts.items() if verdict.slow)


__all__ = [
    "CLEAR_RATIO",
    "LASTING_NS",
    "SLOW_RATIO",
    "ModelKey",
    "RangeWork",
    "SlowStageWatch",
    "SlowVerdict",
    "StageFigure",
    "StageRatio",
    "layer_count",
    "stage_figures",
    "stage_ratios",
]
