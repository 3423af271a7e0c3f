"""Layer ranges for a pipeline whose stages cost alike, priced in the weight bytes a decode step
reads, over each stage's speed where the nodes differ (issue 55). Pure.

Nodes on machines of their own compute different sessions at the same time (issue 15's
cohorts), so a route runs at the pace of its slowest stage. A decode step reads every weight of
a stage once, and for a few sessions at a time that read is what a step costs on a CPU or a
GPU, so a stage's bytes stand for its time. Two tables are priced by use, not by size (what
:mod:`.layer_costs` prices for memory): the token embedding is a lookup of one row per token,
so the first stage pays nothing for it; the output projection (``output``, or the embedding a
model ties to it) is a full product at the last stage. On a model with a large vocabulary and
few, narrow layers this matters more than the layers: Gemma 3 270M's 262 144 x 640 projection
reads more than its 18 layers together, so an even split of the layers leaves the last stage
the slowest by far (bench/RESULTS.md, "A light tail").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Range = tuple[int, int]
# Whether stage ``index`` can hold layers ``[start, end)`` (its node's memory): (index, start, end).
StageFits = Callable[[int, int, int], bool]

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class StepCosts:
    """The bytes a decode step reads: each layer's, and the output projection's at the last."""

    per_layer: tuple[int, ...]
    output: int

    def stage(self, layers: Range) -> int:
        start, end = layers
        return sum(self.per_layer[start:end]) + (self.output if end == len(self.per_layer) else 0)


def step_costs(n_layers: int, tensor_bytes: Mapping[str, int]) -> StepCosts:
    """A model's :class:`StepCosts` from its tensors' sizes (``name -> bytes``, GGUF names)."""
    if n_layers < 1:
        raise ValueError("a model has at least one layer")
    per_layer = [0] * n_layers
    for name, size in tensor_bytes.items():
        found = _BLOCK.match(name)
        if found is not None and int(found.group(1)) < n_layers:
            per_layer[int(found.group(1))] += size
    tables = {
        name.split(".", 1)[0]: size for name, size in tensor_bytes.items() if _BLOCK.match(name) is None
    }
    # A model without an output tensor computes its logits with the (tied) token embedding.
    output = tables.get("output", tables.get("token_embd", 0))
    return StepCosts(tuple(per_layer), output)


def _heaviest_first(costs: Sequence[float]) -> tuple[float, ...]:
    return tuple(sorted(costs, reverse=True))


class NoSplitError(ValueError):
    """No ranges of the layers fit the stages' memory."""


def balanced_ranges(
    costs: StepCosts,
    stages: int,
    min_layers: int = 1,
    *,
    speeds: Sequence[float] | None = None,
    fits: StageFits | None = None,
) -> list[Range]:
    """``stages`` contiguous ranges of at least ``min_layers`` layers each (of one where the model
    has too few for that) covering every layer, in order, whose slowest stage is as fast as can
    be; of those, the one whose next slowest is fastest, and so on (the stage costs compared
    heaviest first), and then the one with the earliest boundaries.

    ``speeds``, one a stage (any unit, larger is faster; default all alike): a stage's time is
    its bytes over its speed, so a node twice as fast gets about twice the bytes. ``fits``: only
    ranges a stage can hold (its node's memory); :class:`NoSplitError` when no split fits.

    Dynamic programming over (layers covered, stages used); comparing heaviest-first cost
    vectors is preserved by adding the same stage to both, so the best way to cover a prefix
    is part of the best way to cover the whole."""
    n_layers = len(costs.per_layer)
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{stages} stages for {n_layers} layers: each stage needs a layer")
    if speeds is not None and (len(speeds) != stages or min(speeds) <= 0):
        raise ValueError(f"{stages} stages need {stages} positive speeds, not {list(speeds)}")
    shortest = min_layers if stages * min_layers <= n_layers else 1
    prefix = [0]
    for size in costs.per_layer:
        prefix.append(prefix[-1] + size)

    def cost(index: int, start: int, end: int) -> float:
        size = prefix[end] - prefix[start] + (costs.output if end == n_layers else 0)
        # Twelve significant digits: equal times that float division tells apart stay equal.
        return size if speeds is None else float(f"{size / speeds[index]:.12g}")

    # best[s][end]: the best (heaviest-first costs, boundaries) covering [0, end) with s stages.
    best: list[dict[int, tuple[tuple[float, ...], tuple[int, ...]]]] = [{0: ((), ())}]
    for used in range(1, stages + 1):
        row: dict[int, tuple[tuple[float, ...], tuple[int, ...]]] = {}
        # Room for the shortest range each for the stages still to come.
        for end in range(used * shortest, n_layers - (stages - used) * shortest + 1):
            candidates = []
            for start, (before, bounds) in best[used - 1].items():
                if start + shortest <= end and (fits is None or fits(used - 1, start, end)):
                    merged = _heaviest_first((*before, cost(used - 1, start, end)))
                    candidates.append((merged, (*bounds, end)))
            if candidates:
                row[end] = min(candidates)
        best.append(row)
    if n_layers not in best[stages]:
        raise NoSplitError(f"no split of {n_layers} layers over {stages} stages fits their memory")
    _, bounds = best[stages][n_layers]
    starts = (0, *bounds[:-1])
    return list(zip(starts, bounds, strict=True))


def even_ranges(n_layers: int, stages: int) -> list[Range]:
    """The layers split as evenly as counts go, the larger ranges first."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{stages} stages for {n_layers} layers: each stage needs a layer")
    size, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for index in range(stages):
        end = start + size + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


__all__ = ["NoSplitError", "Range", "StageFits", "StepCosts", "balanced_ranges", "even_ranges", "step_costs"]
