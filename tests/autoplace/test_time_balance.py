"""meshnode.autoplace.time_balance: a joiner's range sized by its speed against the peers', the
memory-only choice where speed gains nothing, and moves only for a lasting gain."""

from __future__ import annotations

import pytest

from meshnode.autoplace.time_balance import (
    TimedRange,
    TimeReplacement,
    choose_range_by_time,
    fastest_range,
    range_gaining_time,
    route_bottleneck,
    us_per_layer,
)
from meshnode.mesh.placement import choose_range

LAYERS = 12
UNIFORM = [10] * LAYERS  # bytes per layer
ALL = 10 * LAYERS  # a budget that holds every layer
FAST = 1_000.0  # us per layer per token
SLOW = 3 * FAST
SECOND = 1_000_000_000


def test_per_layer_time_is_the_announced_decode_time_over_the_layers_served() -> None:
    assert us_per_layer(12_000, (0, 12)) == 1_000
    assert us_per_layer(3_000, (4, 7)) == 1_000
    with pytest.raises(ValueError):
        us_per_layer(1_000, (3, 3))
    with pytest.raises(ValueError):
        us_per_layer(0, (0, 1))


def test_the_best_route_is_the_chain_whose_slowest_stage_is_fastest() -> None:
    whole = TimedRange((0, LAYERS), FAST)
    assert route_bottleneck(LAYERS, [whole]) == 12 * FAST
    # A hop runs to the end of its range, its start trimmed to where the previous hop ended.
    assert route_bottleneck(LAYERS, [whole, TimedRange((0, 6), FAST)]) == 6 * FAST
    assert route_bottleneck(LAYERS, [TimedRange((0, 6), FAST)]) == float("inf")
    # [0, 8) hands over at 8: the slow [6, 12) runs [8, 12), 12 ms; the whole range's tail 4 ms.
    assert route_bottleneck(LAYERS, [TimedRange((0, 8), FAST), TimedRange((6, 12), SLOW)]) == 12 * FAST
    assert route_bottleneck(LAYERS, [whole, TimedRange((0, 8), FAST), TimedRange((6, 12), SLOW)]) == 8 * FAST
    assert route_bottleneck(LAYERS, [TimedRange((0, 4), FAST), TimedRange((6, 12), FAST)]) == float("inf")


def test_a_node_a_third_as_fast_takes_a_third_of_the_layers_the_fast_one_runs() -> None:
    fast = TimedRange((0, LAYERS), FAST)
    layers = choose_range_by_time(LAYERS, UNIFORM, ALL, [fast], SLOW)
    assert layers == (0, 3)  # then the fast node runs [3, 12): 9 layers against 3, 9 ms each
    assert route_bottleneck(LAYERS, [fast, TimedRange(layers, SLOW)]) == 9 * FAST
    # By memory alone it would have taken every layer its budget holds.
    assert choose_range(LAYERS, UNIFORM, ALL, [(0, LAYERS)], [], b"\x01") == (0, LAYERS)


def test_a_fast_node_takes_more_layers_than_a_slow_one_serving_them_all() -> None:
    slow = TimedRange((0, LAYERS), SLOW)
    assert choose_range_by_time(LAYERS, UNIFORM, ALL, [slow], FAST) == (0, 9)


def test_a_node_that_helps_no_route_is_placed_by_memory() -> None:
    """A first fast node serves everything, a second as fast takes half of it; a third, a third as
    fast, joins. The best route (6 ms, the second's [0, 6) and the first's tail) cannot get faster
    while the first keeps its range, so the third takes what memory-only placement gives it."""
    first = TimedRange((0, LAYERS), FAST)
    second = choose_range_by_time(LAYERS, UNIFORM, ALL, [first], FAST)
    assert second == (0, 6)
    others = [first, TimedRange(second, FAST)]
    assert route_bottleneck(LAYERS, others) == 6 * FAST
    assert choose_range_by_time(LAYERS, UNIFORM, 60, others, SLOW) == choose_range(
        LAYERS, UNIFORM, 60, [(0, LAYERS), second], [], b"\x01"
    )


def test_the_memory_budget_bounds_a_fast_node() -> None:
    slow = TimedRange((0, LAYERS), SLOW)
    # Room for six layers only: six fast layers and six slow ones, the slow stage 18 ms.
    assert choose_range_by_time(LAYERS, UNIFORM, 60, [slow], FAST) == (0, 6)
    assert choose_range_by_time(LAYERS, UNIFORM, 9, [slow], FAST) is None


def test_uncovered_layers_still_come_first_and_the_joiner_takes_no_more_than_it_runs() -> None:
    head = TimedRange((0, 2), FAST)
    # The gap [2, 12) must be covered whatever the speed; a slow joiner takes just the gap.
    assert choose_range_by_time(LAYERS, UNIFORM, ALL, [head], SLOW) == (2, LAYERS)
    # Two gaps no window of the budget closes: memory-only, the most uncovered layers.
    gaps = [TimedRange((2, 4), FAST), TimedRange((6, 8), FAST)]
    assert choose_range_by_time(LAYERS, UNIFORM, 40, gaps, FAST) == choose_range(
        LAYERS, UNIFORM, 40, [(2, 4), (6, 8)], [], b"\x01"
    )


def test_where_speed_gains_too_little_placement_is_memory_only() -> None:
    fast = TimedRange((0, LAYERS), FAST)
    # A node 20 times slower would cut the 12 ms stage to 11.4 ms at best (a 5 % gain): it takes
    # what memory-only placement gives it.
    crawling = 20 * FAST
    found = fastest_range(LAYERS, UNIFORM, ALL, [fast], crawling)
    assert found is not None and found.gain < 0.1
    assert range_gaining_time(LAYERS, UNIFORM, ALL, [fast], crawling) is None
    assert range_gaining_time(LAYERS, UNIFORM, ALL, [fast], SLOW) == (0, 3)
    assert choose_range_by_time(LAYERS, UNIFORM, 60, [fast], crawling) == choose_range(
        LAYERS, UNIFORM, 60, [(0, LAYERS)], [], b"\x01"
    )


def test_equal_windows_go_to_the_shortest_then_the_lowest_start() -> None:
    # Two fast nodes on [0, 6) and [6, 12): a third as fast cannot make the 6 ms stages faster, so
    # every window is worth the same and the shortest at the lowest start is reported.
    halves = [TimedRange((0, 6), FAST), TimedRange((6, 12), FAST)]
    found = fastest_range(LAYERS, UNIFORM, ALL, halves, FAST)
    assert found is not None and found.gain == 0  # a third stage of equal speed: 6 ms stays 6 ms
    assert found.layers == (0, 1)


def test_a_short_lived_slowdown_moves_nobody_and_a_lasting_one_does() -> None:
    """The fast node serves [3, 12) and the slow one [0, 3). The fast node's own speed stays; the
    slow peer's announced figure drops to a ninth for a while: [0, 3) then costs 27 ms a token
    and the fast node would do better taking every layer."""
    replacement = TimeReplacement(settle_ns=60 * SECOND)
    current = (0, LAYERS)
    head = TimedRange((0, 3), SLOW)
    slowed = TimedRange((0, 3), 9 * SLOW)
    assert replacement.consider(current, LAYERS, UNIFORM, ALL, [head], FAST, 0) is None  # as good as it gets
    mine = (3, LAYERS)
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [head], FAST, 0) is None
    # A short slowdown: the better range appears, then goes before the settle time.
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [slowed], FAST, 1 * SECOND) is None
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [slowed], FAST, 30 * SECOND) is None
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [head], FAST, 40 * SECOND) is None
    # Slowed again: the settle time counts from now, not from the first slowdown.
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [slowed], FAST, 50 * SECOND) is None
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [slowed], FAST, 100 * SECOND) is None
    # A lasting slowdown: past the settle time the fast node takes every layer.
    assert replacement.consider(mine, LAYERS, UNIFORM, ALL, [slowed], FAST, 110 * SECOND) == (0, LAYERS)


def test_a_gain_below_the_threshold_moves_nobody_however_long_it_lasts() -> None:
    replacement = TimeReplacement(min_gain=0.2, settle_ns=10 * SECOND)
    # The fast node on [3, 12) (9 ms) beside a slow [0, 3) (9 ms), best route 9 ms. The slow node
    # announcing 10 % slower makes its stage 9.9 ms; taking [0, 12) alone (12 ms) is no better.
    slower = TimedRange((0, 3), 1.1 * SLOW)
    for second in range(0, 100, 10):
        assert (
            replacement.consider((3, LAYERS), LAYERS, UNIFORM, ALL, [slower], FAST, second * SECOND) is None
        )


def test_layers_nobody_serves_move_a_node_as_before() -> None:
    replacement = TimeReplacement(settle_ns=5 * SECOND)
    # The node on [0, 6) is gone: the node on [0, 6) too must cover [6, 12), its budget holding 12.
    others = [TimedRange((0, 6), FAST)]
    assert replacement.consider((0, 6), LAYERS, UNIFORM, ALL, others, FAST, 0) is None
    assert replacement.consider((0, 6), LAYERS, UNIFORM, ALL, others, FAST, 5 * SECOND) == (6, LAYERS)
    with pytest.raises(ValueError):
        TimeReplacement(min_gain=0)


def test_a_slow_node_in_the_middle_no_longer_holds_a_faster_one_back() -> None:
    """The slowed node joined first and serves the middle [4, 11), a fast one [0, 4); the second fast
    node, whose budget holds 7 layers, serves the uncovered [11, 12). Every route ran all of the
    slow node's layers whatever the fast node took (a hop runs to its range's end), so it saw no
    gain in moving, and the slow node could not give up layers nobody else served. Modelled as
    able to give up the end of its range, the slow node leaves the fast node a window that gains:
    [6, 12), after which the slow node keeps [4, 6), two layers at three times the time of a fast
    one's six (the ideal split)."""
    others = [TimedRange((0, 4), FAST), TimedRange((4, 11), SLOW)]
    seven = 7 * 10
    current = (11, LAYERS)
    now = route_bottleneck(LAYERS, [*others, TimedRange(current, FAST)])
    assert now == 7 * SLOW
    replacement = TimeReplacement(settle_ns=10 * SECOND)
    assert replacement.consider(current, LAYERS, UNIFORM, seven, others, FAST, 0) is None
    moved_to = replacement.consider(current, LAYERS, UNIFORM, seven, others, FAST, 11 * SECOND)
    assert moved_to == (6, LAYERS)
    # Once the slow node gave up what the fast one serves, the route is what the choice modelled.
    after = route_bottleneck(LAYERS, [others[0], TimedRange((4, 6), SLOW), TimedRange(moved_to, FAST)])
    assert after == 6 * FAST
    assert fastest_range(LAYERS, UNIFORM, seven, others, FAST).bottleneck_us == after


def test_a_node_only_somewhat_slower_is_not_modelled_as_ending_early() -> None:
    """Below SLOW_RATIO the other node gets no slow verdict and keeps its range (no yield), so no
    window is chosen for a route it would not make."""
    somewhat = 1.5 * FAST
    others = [TimedRange((0, 4), FAST), TimedRange((4, 11), somewhat)]
    found = fastest_range(LAYERS, UNIFORM, 7 * 10, others, FAST)
    assert found is not None
    assert found.bottleneck_us == 7 * somewhat  # its whole [4, 11) stays on every route
