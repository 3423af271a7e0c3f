"""What computing part of a served range costs, from the weights its GGUF holds.

A route may enter a node's range past its start (the planner trims a hop to where the one
before it ended), so a batch often runs only the range's end. The node announces the time of
its whole range, so it scales such a batch by the share of the range's work it ran
(meshnode.dataplane.batch_stats). Layers differ little in cost, but the output projection at a
model's last layer often weighs more than a layer: by the weight bytes a decode step reads, one
layer and the output of a seven-layer tail are about 0.3 of its work, not 1/7.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshnode.autoplace.stage_balance import StepCosts, step_costs

RangeWork = Callable[[int, int], float]


def range_work_of_costs(costs: StepCosts) -> RangeWork:
    def work(start: int, end: int) -> float:
        return float(costs.stage((start, end)))

    return work


def range_work_of_file(path: Path, total_layers: int, start: int, end: int) -> RangeWork | None:
    """The weight bytes a step of layers [a, b) within [start, end) reads, from the GGUF at ``path``
    (the whole model or a slice of the range); None when it cannot be read or lacks some layer of
    the range or, at the model's end, the output projection (then layers are the measure)."""
    from engines.gguf_file import GGUFFormatError, read_gguf

    try:
        gguf = read_gguf(path)
        costs = step_costs(total_layers, {tensor.name: tensor.nbytes for tensor in gguf.tensors})
    except (OSError, GGUFFormatError, ValueError):
        return None
    if not all(costs.per_layer[start:end]) or (end == total_layers and costs.output == 0):
        return None
    return range_work_of_costs(costs)


__all__ = ["RangeWork", "range_work_of_costs", "range_work_of_file"]
