"""What each layer of a model costs a node that serves it, from the tensors a range needs. Pure.

A range needs its own ``blk.N.*`` tensors, plus the tables of its role: the first range
the token embedding, the last the output norm and projection (or the tied embedding),
every range the few tensors all share (``engines.slicing.tensors_for_range`` says which).
The role tables are priced into the end layers, so a budget that cannot hold the
vocabulary-sized embedding never takes the first or the last layer, and
:func:`meshnode.mesh.placement.best_range` can keep adding per-layer costs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# The tensors a shard of [start, end) needs (engines.slicing.tensors_for_range over a header).
TensorsForRange = Callable[[int, int], frozenset[str]]

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class LayerCosts:
    # Bytes of each layer, the first and last layer carrying their role's tables.
    per_layer: tuple[int, ...]
    # Bytes every range needs whatever its layers.
    shared: int

    def range_bytes(self, start: int, end: int) -> int:
        return self.shared + sum(self.per_layer[start:end])


def _block_of(name: str) -> int | None:
    found = _BLOCK.match(name)
    return None if found is None else int(found.group(1))


def _tables(names: frozenset[str]) -> set[str]:
    return {name for name in names if _block_of(name) is None}


def layer_costs(n_layers: int, tensor_bytes: Mapping[str, int], needs: TensorsForRange) -> LayerCosts:
    """Per-layer costs of a model whose tensors have ``tensor_bytes`` and whose ranges need ``needs``.

    A table both ends need (a tied embedding) is priced into both end layers, so the
    whole-model range counts it twice: an overestimate, never an underestimate."""
    if n_layers < 1:
        raise ValueError("a model has at least one layer")
    per_layer = [0] * n_layers
    for name, size in tensor_bytes.items():
        block = _block_of(name)
        if block is not None and 0 <= block < n_layers:
            per_layer[block] += size
    first, last = _tables(needs(0, 1)), _tables(needs(n_layers - 1, n_layers))
    shared = first & last
    if n_layers > 2:
        shared &= _tables(needs(1, n_layers - 1))
    per_layer[0] += sum(tensor_bytes[name] for name in first - shared)
    if n_layers > 1:
        per_layer[-1] += sum(tensor_bytes[name] for name in last - shared)
    return LayerCosts(tuple(per_layer), sum(tensor_bytes[name] for name in shared))


__all__ = ["LayerCosts", "TensorsForRange", "layer_costs"]
