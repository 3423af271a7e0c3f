"""meshnode.autoplace.slow_yield: a slow node gives up the layers faster replicas serve, keeps those
only it serves, moves only for a lasting slow verdict, and placement by time does not take the
layers back."""

from __future__ import annotations

import pytest

from meshnode.autoplace.slow_yield import FASTER_MARGIN, Replica, SlowYield, yield_plan
from meshnode.autoplace.time_balance import TimedRange, TimeReplacement, route_bottleneck
from meshnode.identity import short_id
from meshnode.mesh.placement import Range

LAYERS = 12
UNIFORM = [10] * LAYERS  # bytes per layer
ALL = 10 * LAYERS  # a budget that holds every layer
FAST = 1_000.0  # us per layer per token
SLOW = 3 * FAST
SECOND = 1_000_000_000
SETTLE = 60 * SECOND
JOIN_MIN_GAIN = 0.1

C, F, G = b"\x0c" * 32, b"\x0f" * 32, b"\x06" * 32


def timed(replicas: list[Replica]) -> list[TimedRange]:
    return [TimedRange(replica.layers, replica.us_per_layer) for replica in replicas]


def plan_for(current: Range, replicas: list[Replica], own: float = SLOW):
    return yield_plan(
        current, LAYERS, UNIFORM, ALL, replicas, timed(replicas), own, join_min_gain=JOIN_MIN_GAIN
    )


def test_a_slow_node_gives_up_the_layers_a_faster_replica_serves_and_keeps_the_rest() -> None:
    replicas = [Replica(C, (0, 4), FAST), Replica(F, (4, 8), FAST)]
    plan = plan_for((4, 12), replicas)
    assert plan is not None
    assert plan.target == (8, 12)
    assert plan.given_up == ((4, 8),)
    assert plan.faster == (F,)
    assert not plan.moved
    assert plan.describe() == (
        f"stage 3.00 ms/layer vs median 1.00; layers [4, 8) served faster by node {short_id(F)}; "
        "now serving [8, 12)"
    )
    # Every layer stays covered, and the best route is no slower: C, F, then the slow node's four.
    stages = [*timed(replicas), TimedRange(plan.target, SLOW)]
    assert route_bottleneck(LAYERS, stages) == 12 * FAST


def test_layers_only_this_node_serves_are_kept_and_a_range_stays_contiguous() -> None:
    # F serves the head faster: given up. The tail only this node serves: kept.
    plan = plan_for((0, 12), [Replica(F, (0, 6), FAST)])
    assert plan is not None and plan.target == (6, 12) and plan.given_up == ((0, 6),)
    # Served faster at both ends: both runs are given up in one yield.
    plan = plan_for((0, 12), [Replica(F, (0, 3), FAST), Replica(G, (9, 12), FAST)])
    assert plan is not None and plan.target == (3, 9) and plan.given_up == ((0, 3), (9, 12))
    assert plan.faster == tuple(sorted((F, G)))
    # Served faster only between layers it must keep: a node serves one range, so it keeps them all.
    assert plan_for((0, 12), [Replica(F, (4, 8), FAST)]) is None


def test_no_faster_replica_no_yield() -> None:
    assert plan_for((4, 12), []) is None
    assert plan_for((4, 12), [Replica(C, (0, 4), FAST)]) is None
    # A replica of its layers faster by less than the margin is not faster: the layers are kept.
    alike = SLOW / (1 + FASTER_MARGIN) * 1.01
    assert plan_for((4, 12), [Replica(C, (0, 4), FAST), Replica(F, (4, 8), alike)]) is None
    # A slower one neither.
    assert plan_for((4, 12), [Replica(C, (0, 4), FAST), Replica(F, (4, 8), 2 * SLOW)]) is None


def test_a_yield_that_would_slow_the_best_route_is_not_made() -> None:
    """F serves [3, 12) faster per layer than this node, but as one hop of nine layers: given
    [3, 6), it would run them all (13.5 ms) where the route now hands over to it at 6 (12 ms)."""
    replicas = [Replica(F, (3, LAYERS), 1.5 * FAST)]
    own = 2 * FAST
    assert plan_for((0, 6), replicas, own) is None
    assert route_bottleneck(LAYERS, [*timed(replicas), TimedRange((0, 6), own)]) == 12 * FAST
    assert route_bottleneck(LAYERS, [*timed(replicas), TimedRange((0, 3), own)]) == 13.5 * FAST


def test_a_node_whose_every_layer_is_served_faster_goes_where_placement_by_time_puts_it() -> None:
    # F serves the whole model in 12 ms; the slow node's [0, 4) saves nothing (a hop through it
    # runs all four, 12 ms). Three of them and F's other nine: 9 ms each.
    replicas = [Replica(F, (0, LAYERS), FAST)]
    plan = plan_for((0, 4), replicas)
    assert plan is not None
    assert plan.moved and plan.target == (0, 3) and plan.given_up == ((3, 4),) and plan.faster == (F,)
    assert route_bottleneck(LAYERS, [*timed(replicas), TimedRange(plan.target, SLOW)]) == 9 * FAST
    # Ten times slower, no window gains: it stays, a spare replica, rather than re-placing by
    # memory (which would take every layer its budget holds, those it gives up among them).
    halves = [Replica(C, (0, 6), FAST), Replica(F, (6, LAYERS), FAST)]
    assert plan_for((0, 4), halves, 10 * FAST) is None


def test_placement_by_time_does_not_take_the_given_up_layers_back() -> None:
    cases = [
        ((4, 12), [Replica(C, (0, 4), FAST), Replica(F, (4, 8), FAST)]),
        ((0, 12), [Replica(F, (0, 6), FAST)]),
        ((0, 4), [Replica(F, (0, LAYERS), FAST)]),
    ]
    for current, replicas in cases:
        plan = plan_for(current, replicas)
        assert plan is not None
        # Served from the new range: placement by time sees nothing better, and no further yield.
        move = TimeReplacement(settle_ns=0).target(plan.target, LAYERS, UNIFORM, ALL, timed(replicas), SLOW)
        assert move is None, (current, plan.target, move)
        assert plan_for(plan.target, replicas) is None


def watch(
    rule: SlowYield, current: Range, replicas: list[Replica], spells: list[tuple[int, bool]]
) -> list[tuple[int, Range]]:
    """Feed ``rule`` the verdict of each ``(second, slow)``; the yields it makes, by second."""
    made = []
    for second, slow in spells:
        plan = rule.consider(
            slow, current, LAYERS, UNIFORM, ALL, replicas, timed(replicas), SLOW, second * SECOND
        )
        if plan is not None:
            made.append((second, plan.target))
    return made


REPLICAS = [Replica(C, (0, 4), FAST), Replica(F, (4, 8), FAST)]


def test_a_lasting_slow_verdict_gives_up_the_layers_after_the_settle_time() -> None:
    rule = SlowYield(join_min_gain=JOIN_MIN_GAIN, settle_ns=SETTLE)
    assert watch(rule, (4, 12), REPLICAS, [(second, True) for second in range(0, 66, 5)]) == [(60, (8, 12))]


def test_a_short_lived_slow_spell_moves_nothing() -> None:
    rule = SlowYield(join_min_gain=JOIN_MIN_GAIN, settle_ns=SETTLE)
    # Slow for 50 s, then not for a moment, then slow again: the settle time starts over.
    spells = [(second, second != 55) for second in range(0, 110, 5)]
    assert watch(rule, (4, 12), REPLICAS, spells) == []
    assert rule.pending is not None and rule.pending_since_ns == 60 * SECOND


def test_a_cleared_verdict_moves_nothing() -> None:
    rule = SlowYield(join_min_gain=JOIN_MIN_GAIN, settle_ns=SETTLE)
    spells = [(second, second < 30) for second in range(0, 300, 5)]
    assert watch(rule, (4, 12), REPLICAS, spells) == []
    assert rule.pending is None


def test_no_faster_replica_moves_nothing_however_long_the_node_is_slow() -> None:
    rule = SlowYield(join_min_gain=JOIN_MIN_GAIN, settle_ns=SETTLE)
    only = [Replica(C, (0, 4), FAST)]
    assert watch(rule, (4, 12), only, [(second, True) for second in range(0, 600, 5)]) == []


def test_a_yield_needs_a_positive_settle_gain() -> None:
    with pytest.raises(ValueError):
        SlowYield(join_min_gain=0, settle_ns=SETTLE)
    with pytest.raises(ValueError):
        SlowYield(join_min_gain=JOIN_MIN_GAIN, settle_ns=-1)
