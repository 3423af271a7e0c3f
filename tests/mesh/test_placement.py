"""meshnode.mesh.placement: the range a joining node takes, simultaneous joiners, and moves
only for a large and lasting gain."""

from __future__ import annotations

import pytest

from meshnode.mesh.placement import (
    Claim,
    Replacement,
    affordable_layers,
    choose_range,
    claim_keeps,
    replica_counts,
)

LAYERS = 18
UNIFORM = [10] * LAYERS  # bytes per layer
SECOND = 1_000_000_000


def test_an_empty_mesh_gets_the_first_layers_its_budget_holds() -> None:
    assert choose_range(LAYERS, UNIFORM, 90, [], [], b"\x01") == (0, 9)
    assert choose_range(LAYERS, UNIFORM, 1000, [], [], b"\x01") == (0, 18)


def test_uncovered_layers_come_first() -> None:
    assert choose_range(LAYERS, UNIFORM, 90, [(0, 9)], [], b"\x01") == (9, 18)
    # A six-layer gap and room for nine: the gap and the three least-replicated layers before it.
    assert choose_range(LAYERS, UNIFORM, 90, [(0, 12)], [], b"\x01") == (9, 18)


def test_with_everything_covered_the_least_replicated_range_is_taken() -> None:
    served = [(0, 18), (0, 18), (0, 9)]
    assert replica_counts(LAYERS, served) == [3] * 9 + [2] * 9
    assert choose_range(LAYERS, UNIFORM, 90, served, [], b"\x01") == (9, 18)


def test_the_budget_sizes_the_range_by_each_layers_bytes() -> None:
    sizes = [50, 10, 10, 10, *[10] * 14]
    assert affordable_layers(sizes, 0, 70) == 3
    assert choose_range(LAYERS, sizes, 40, [], [], b"\x01") == (1, 5)
    assert choose_range(LAYERS, UNIFORM, 9, [], [], b"\x01") is None  # not even one layer
    with pytest.raises(ValueError, match="17 layer sizes for 18 layers"):
        choose_range(LAYERS, UNIFORM[:-1], 90, [], [], b"\x01")


def test_two_nodes_joining_at_once_end_on_different_ranges() -> None:
    served = [(0, 9)]
    low, high = b"\x01" * 32, b"\x02" * 32
    # Each first chooses alone and announces it: both would take the gap.
    first_low = choose_range(LAYERS, UNIFORM, 90, served, [], low)
    first_high = choose_range(LAYERS, UNIFORM, 90, served, [], high)
    assert first_low == first_high == (9, 18)
    claims = [Claim(low, first_low), Claim(high, first_high)]
    # With both claims seen, the lower id keeps the gap and the higher one yields.
    assert choose_range(LAYERS, UNIFORM, 90, served, claims, low) == (9, 18)
    assert choose_range(LAYERS, UNIFORM, 90, served, claims, high) == (0, 9)


def test_a_node_moves_only_for_a_gain_that_lasts() -> None:
    mover = Replacement(min_gain_layers=2, settle_ns=60 * SECOND)
    # Serving [0, 4) while the rest serve [9, 18): [0, 9) would cover 5 more uncovered layers.
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 0) is None
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 59 * SECOND) is None
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 60 * SECOND) == (0, 9)


def test_coverage_that_flickers_moves_nobody() -> None:
    mover = Replacement(min_gain_layers=2, settle_ns=60 * SECOND)
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 0) is None
    # Someone else covers the gap for a moment: the wait starts over.
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(4, 18)], 30 * SECOND) is None
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 61 * SECOND) is None
    assert mover.consider((0, 4), LAYERS, UNIFORM, 90, [(9, 18)], 121 * SECOND) == (0, 9)


def test_a_small_gain_never_moves_a_node() -> None:
    mover = Replacement(min_gain_layers=3, settle_ns=0)
    # [0, 9) would take 1 uncovered layer more than [0, 8): below the threshold.
    assert mover.consider((0, 8), LAYERS, UNIFORM, 90, [(9, 18)], 0) is None
    # Where the node is is already the best: no move.
    assert mover.consider((0, 9), LAYERS, UNIFORM, 90, [(9, 18)], 0) is None


def test_of_two_claims_the_one_faster_by_the_margin_keeps_the_range_else_the_lower_id():
    low, high = b"\x01" * 32, b"\x02" * 32
    # Unknown speeds, or alike within the margin: the lower node id keeps, as before.
    assert claim_keeps(low, None, high, 1_000.0) and not claim_keeps(high, 1_000.0, low, None)
    assert claim_keeps(low, 1_200.0, high, 1_000.0) and not claim_keeps(high, 1_000.0, low, 1_200.0)
    # Faster by more than the margin: the faster keeps, whatever its id.
    assert claim_keeps(high, 1_000.0, low, 3_000.0) and not claim_keeps(low, 3_000.0, high, 1_000.0)
    # Exactly one side keeps, for any pair: both sides compute the same answer.
    for a, b in [(500.0, 620.0), (500.0, 630.0), (None, 10.0), (7.0, 7.0), (1.0, 100.0)]:
        assert claim_keeps(low, a, high, b) != claim_keeps(high, b, low, a)


def test_a_claim_that_does_not_keep_its_range_does_not_count_as_served():
    layer_bytes = [10] * 6
    slow_claim = Claim(b"\x01" * 32, (2, 6))
    # By node id the lower id's claim is served, so this node takes what is left to replicate.
    assert choose_range(6, layer_bytes, 40, [(0, 2)], [slow_claim], b"\x02" * 32) != (2, 6)
    # Told the claim yields (a slower claimer), this node takes the gap itself.
    assert choose_range(6, layer_bytes, 40, [(0, 2)], [slow_claim], b"\x02" * 32, lambda claim: False) == (
        2,
        6,
    )
