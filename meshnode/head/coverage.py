"""How the shards a node knows of cover a model's layers, for ``/v1/models``.

A model of ``total_layers`` layers is split at every announced shard boundary;
each span says how many shards serve all of its layers (its replicas), and
adjacent spans with the same count are merged. A span with 0 replicas is a gap:
no route exists until some node serves it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from meshnode.head.planner import ModelIdentity, ShardCandidate


@dataclass(frozen=True)
class CoverageSpan:
    start_layer: int
    end_layer: int
    replicas: int


@dataclass(frozen=True)
class ModelCoverage:
    total_layers: int
    # Ascending, contiguous from 0 to total_layers.
    spans: tuple[CoverageSpan, ...]


def layer_coverage(candidates: Iterable[ShardCandidate], model: ModelIdentity) -> ModelCoverage:
    total = model.total_layers
    shards = [
        (max(0, c.start_layer), min(total, c.end_layer))
        for c in candidates
        if c.model == model and c.start_layer < c.end_layer
    ]
    bounds = sorted({0, total, *(edge for shard in shards for edge in shard)})
    spans: list[CoverageSpan] = []
    for start, end in itertools.pairwise(bounds):
        replicas = sum(1 for first, last in shards if first <= start and end <= last)
        if spans and spans[-1].replicas == replicas:
            spans[-1] = CoverageSpan(spans[-1].start_layer, end, replicas)
        else:
            spans.append(CoverageSpan(start, end, replicas))
    return ModelCoverage(total, tuple(spans))


__all__ = ["CoverageSpan", "ModelCoverage", "layer_coverage"]
