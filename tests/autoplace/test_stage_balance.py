"""Layer ranges whose stages cost alike, priced in the bytes a decode step reads."""

from __future__ import annotations

import itertools
import random

import pytest

from meshnode.autoplace.stage_balance import NoSplitError, StepCosts, balanced_ranges, even_ranges, step_costs

# Gemma 3 270M's shape: 18 layers of 3.6-4.0 MB and a tied 262 144 x 640 embedding of 178 MB.
GEMMA_LIKE = StepCosts(
    per_layer=tuple(4_000_000 if i % 3 == 0 else 3_600_000 for i in range(18)), output=178_000_000
)


def exhaustive(costs: StepCosts, stages: int, min_layers: int = 1) -> list[tuple[int, int]]:
    """Every way to cut the layers, the best by the rule balanced_ranges promises."""
    n_layers = len(costs.per_layer)
    shortest = min_layers if stages * min_layers <= n_layers else 1
    best: tuple[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] | None = None
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *cuts, n_layers)
        ranges = list(itertools.pairwise(bounds))
        if any(end - start < shortest for start, end in ranges):
            continue
        key = (tuple(sorted((costs.stage(r) for r in ranges), reverse=True)), bounds[1:])
        if best is None or key < best[0]:
            best = (key, ranges)
    assert best is not None
    return best[1]


def test_the_slowest_stage_is_as_fast_as_any_cut_allows_and_ties_break_alike():
    rng = random.Random(7)
    for _ in range(1500):
        n_layers = rng.randint(1, 8)
        stages = rng.randint(1, n_layers)
        min_layers = rng.randint(1, 3)
        # Small values on purpose: many ties between cuts.
        per_layer = tuple(rng.choice([rng.randint(0, 4), rng.randint(0, 40)]) for _ in range(n_layers))
        costs = StepCosts(per_layer, rng.randint(0, 50))
        expected = exhaustive(costs, stages, min_layers)
        assert balanced_ranges(costs, stages, min_layers) == expected, (costs, stages, min_layers)


def test_a_vocabulary_heavier_than_the_layers_leaves_the_last_node_the_fewest_layers():
    ranges = balanced_ranges(GEMMA_LIKE, 3)
    assert ranges == [(0, 8), (8, 17), (17, 18)]
    slowest = max(GEMMA_LIKE.stage(r) for r in ranges)
    assert slowest < max(GEMMA_LIKE.stage(r) for r in even_ranges(18, 3))
    assert slowest == GEMMA_LIKE.output + GEMMA_LIKE.per_layer[17]
    # Two layers a node at least (meshnode split's default): the tail keeps two.
    assert balanced_ranges(GEMMA_LIKE, 3, min_layers=2) == [(0, 8), (8, 16), (16, 18)]
    # A model too short for the floor is cut as if there were none.
    assert balanced_ranges(StepCosts((1, 1, 1), 9), 3, min_layers=2) == [(0, 1), (1, 2), (2, 3)]


def test_a_small_output_projection_keeps_the_split_near_even():
    costs = StepCosts(per_layer=(10,) * 12, output=1)
    assert balanced_ranges(costs, 3) == [(0, 4), (4, 8), (8, 12)]
    assert balanced_ranges(costs, 1) == [(0, 12)]


def test_the_output_projection_is_priced_at_the_last_stage_and_the_embedding_lookup_nowhere():
    tied = {
        "token_embd.weight": 900,
        "output_norm.weight": 4,
        "blk.0.attn_q.weight": 10,
        "blk.0.ffn_up.weight": 20,
        "blk.1.attn_q.weight": 10,
        "blk.1.ffn_up.weight": 25,
    }
    costs = step_costs(2, tied)
    assert costs == StepCosts(per_layer=(30, 35), output=900)
    assert costs.stage((0, 1)) == 30
    assert costs.stage((1, 2)) == 935
    # A model with its own output matrix reads that one, not the embedding.
    assert step_costs(2, {**tied, "output.weight": 300}).output == 300


def test_more_nodes_than_layers_is_refused():
    with pytest.raises(ValueError, match="each stage needs a layer"):
        balanced_ranges(StepCosts((1, 2), 3), 3)
    with pytest.raises(ValueError, match="each stage needs a layer"):
        even_ranges(2, 0)
    assert even_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]


def exhaustive_timed(costs: StepCosts, speeds: list[float], fits) -> list[tuple[int, int]] | None:
    """Every cut, stage times as bytes over speed, ranges a stage cannot hold left out."""
    n_layers, stages = len(costs.per_layer), len(speeds)
    best = None
    for cuts in itertools.combinations(range(1, n_layers), stages - 1):
        bounds = (0, *cuts, n_layers)
        ranges = list(itertools.pairwise(bounds))
        if not all(fits(index, *r) for index, r in enumerate(ranges)):
            continue
        times = [costs.stage(r) / speed for r, speed in zip(ranges, speeds, strict=True)]
        key = (tuple(sorted(times, reverse=True)), bounds[1:])
        if best is None or key < best[0]:
            best = (key, ranges)
    return None if best is None else best[1]


def test_with_speeds_and_memory_the_slowest_stage_time_is_as_fast_as_any_cut_allows():
    rng = random.Random(11)
    for _ in range(800):
        n_layers = rng.randint(1, 8)
        stages = rng.randint(1, n_layers)
        costs = StepCosts(tuple(rng.randint(1, 40) for _ in range(n_layers)), rng.randint(0, 50))
        # Speeds as powers of two: stage times stay exact, so ties are ties.
        speeds = [rng.choice([0.25, 0.5, 1.0, 2.0]) for _ in range(stages)]
        caps = [rng.randint(1, n_layers) for _ in range(stages)]

        def fits(index: int, start: int, end: int, caps=caps) -> bool:
            return end - start <= caps[index]

        expected = exhaustive_timed(costs, speeds, fits)
        if expected is None:
            with pytest.raises(NoSplitError):
                balanced_ranges(costs, stages, speeds=speeds, fits=fits)
        else:
            assert balanced_ranges(costs, stages, speeds=speeds, fits=fits) == expected


def test_a_node_a_third_as_fast_gets_a_third_of_the_layers():
    uniform = StepCosts((10,) * 12, 0)
    assert balanced_ranges(uniform, 2, speeds=[1.0, 1 / 3]) == [(0, 9), (9, 12)]
    assert balanced_ranges(StepCosts((10,) * 14, 0), 3, speeds=[1.0, 1.0, 1 / 3]) == [
        (0, 6),
        (6, 12),
        (12, 14),
    ]
    # Memory first: a fast node that holds only four layers leaves the rest to the slow one.
    assert balanced_ranges(
        uniform, 2, speeds=[1.0, 1 / 3], fits=lambda index, start, end: index == 1 or end - start <= 4
    ) == [(0, 4), (4, 12)]
    with pytest.raises(ValueError, match="positive speeds"):
        balanced_ranges(uniform, 2, speeds=[1.0])
    with pytest.raises(ValueError, match="positive speeds"):
        balanced_ranges(uniform, 2, speeds=[1.0, 0.0])
