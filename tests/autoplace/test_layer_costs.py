"""Layer prices from the tensors each role needs."""

from __future__ import annotations

import pytest

from meshnode.autoplace.layer_costs import layer_costs
from meshnode.autoplace.memory_budget import machine_budget

SIZES = {
    "token_embd.weight": 1000,
    "rope_freqs.weight": 7,
    "output_norm.weight": 10,
    "output.weight": 500,
    **{f"blk.{i}.attn_q.weight": 40 for i in range(4)},
    **{f"blk.{i}.ffn_down.weight": 60 for i in range(4)},
}


def needs(start: int, end: int) -> frozenset[str]:
    names = {name for name in SIZES if name.startswith("blk.") and start <= int(name.split(".")[1]) < end}
    names.add("rope_freqs.weight")
    if start == 0:
        names.add("token_embd.weight")
    if end == 4:
        names |= {"output_norm.weight", "output.weight"}
    return frozenset(names)


def test_role_tables_are_priced_into_the_end_layers_and_shared_tensors_once():
    costs = layer_costs(4, SIZES, needs)
    assert costs.per_layer == (100 + 1000, 100, 100, 100 + 510)
    assert costs.shared == 7
    assert costs.range_bytes(1, 3) == 207
    # Every range's price is exactly the bytes of the tensors it needs.
    for start in range(4):
        for end in range(start + 1, 5):
            assert costs.range_bytes(start, end) == sum(SIZES[n] for n in needs(start, end))


def test_a_tied_embedding_is_priced_into_both_ends():
    tied = {k: v for k, v in SIZES.items() if k != "output.weight"}

    def tied_needs(start: int, end: int) -> frozenset[str]:
        names = needs(start, end) - {"output.weight"}
        return names | {"token_embd.weight"} if end == 4 else names

    costs = layer_costs(4, tied, tied_needs)
    assert costs.per_layer[0] == 1100 and costs.per_layer[3] == 100 + 10 + 1000
    assert costs.range_bytes(2, 4) == sum(tied[n] for n in tied_needs(2, 4))


def test_a_model_has_layers():
    with pytest.raises(ValueError):
        layer_costs(0, SIZES, needs)


def test_the_budget_is_half_the_available_memory_unless_capped_lower():
    meminfo = "MemTotal: 4000000 kB\nMemAvailable:    2000000 kB\n"
    assert machine_budget(meminfo, None) == 1_024_000_000
    assert machine_budget(meminfo, 10_000) == 10_000
    assert machine_budget(meminfo, 2**40) == 1_024_000_000
    assert machine_budget("", None) is None
    assert machine_budget("", 123) == 123
