import pytest

from meshnode.head.planner import (
    ModelIdentity,
    NoRouteError,
    ShardCandidate,
    plan_route,
)
from meshnode.identity import short_id

GEMMA = ModelIdentity("sha256:aa", "sha256:r1", 18)
OTHER_RECIPE = ModelIdentity("sha256:aa", "sha256:r2", 18)


def shard(name: str, start: int, end: int, model: ModelIdentity = GEMMA, **kwargs) -> ShardCandidate:
    return ShardCandidate(name.encode().ljust(32, b"\0"), "gemma-3-270m", model, start, end, **kwargs)


def names(route) -> list[str]:
    return [hop.node_id.rstrip(b"\0").decode() for hop in route.hops]


def test_exact_tiling_in_layer_order():
    route = plan_route([shard("c", 12, 18), shard("a", 0, 6), shard("b", 6, 12)], GEMMA)
    assert names(route) == ["a", "b", "c"]
    assert [h.effective_start_layer for h in route.hops] == [0, 6, 12]


def test_overlapping_ranges_start_where_the_previous_hop_stopped():
    route = plan_route([shard("a", 0, 10), shard("b", 6, 18)], GEMMA)
    assert names(route) == ["a", "b"]
    assert [(h.start_layer, h.effective_start_layer) for h in route.hops] == [(0, 0), (6, 10)]


def test_a_whole_model_node_is_one_hop():
    route = plan_route([shard("a", 0, 9), shard("b", 9, 18), shard("solo", 0, 18)], GEMMA)
    assert names(route) == ["solo"]


def test_lower_latency_and_load_win():
    fast = [shard("a", 0, 9), shard("slow", 9, 18, rtt_ms=40), shard("fast", 9, 18, rtt_ms=1)]
    assert names(plan_route(fast, GEMMA)) == ["a", "fast"]
    busy = [shard("a", 0, 9), shard("busy", 9, 18, active_sessions=4, max_sessions=4), shard("idle", 9, 18)]
    assert names(plan_route(busy, GEMMA)) == ["a", "idle"]


def test_excluded_and_draining_nodes_are_skipped():
    pool = [shard("a", 0, 9), shard("b", 9, 18), shard("b2", 9, 18, rtt_ms=5)]
    assert names(plan_route(pool, GEMMA, exclude=frozenset({pool[1].node_id}))) == ["a", "b2"]
    draining = [shard("a", 0, 9), shard("b", 9, 18, accepting=False), shard("b2", 9, 18, rtt_ms=5)]
    assert names(plan_route(draining, GEMMA)) == ["a", "b2"]


def test_mismatched_fingerprints_never_mix():
    pool = [shard("a", 0, 9), shard("b", 9, 18, model=OTHER_RECIPE)]
    with pytest.raises(NoRouteError, match=r"layers \[9, 18\)"):
        plan_route(pool, GEMMA)


def test_a_gap_held_by_another_file_or_recipe_names_the_node_and_both_fingerprints():
    """A person who started the second node with another copy or quantization sees why the
    layers it serves do not count, not only that they are missing."""
    other_file = ModelIdentity("sha256:bb", "sha256:r1", 18)
    other_size = ModelIdentity("sha256:cc", "sha256:r1", 26)  # another model altogether: not named
    pool = [shard("a", 0, 9), shard("b", 9, 18, model=other_file), shard("c", 9, 26, model=other_size)]
    with pytest.raises(NoRouteError) as info:
        plan_route(pool, GEMMA)
    b = short_id(pool[1].node_id)
    assert str(info.value) == (
        "no route covers layers [9, 18) of the model (usable shards: [0,9)); "
        f"node {b} serves [9,18) of another file, fingerprint sha256:bb…: every shard of a route "
        "must load the same GGUF as this one (fingerprint sha256:aa…)"
    )
    with pytest.raises(NoRouteError, match=r"of the same file under another runtime recipe \(sha256:r2…\)"):
        plan_route([shard("a", 0, 9), shard("b", 9, 18, model=OTHER_RECIPE)], GEMMA)
    with pytest.raises(NoRouteError) as plain:
        plan_route([shard("a", 0, 9)], GEMMA)
    assert str(plain.value) == "no route covers layers [9, 18) of the model (usable shards: [0,9))"


def test_hops_that_differ_only_in_numerics_form_one_route_and_keep_their_numerics():
    gpu = "llama-cpp-python 0.3.36; gpu; weight repack off"
    cpu = "llama-cpp-python 0.3.36; cpu; weight repack on"
    route = plan_route([shard("a", 0, 9, numerics=gpu), shard("b", 9, 18, numerics=cpu)], GEMMA)
    assert names(route) == ["a", "b"]
    assert [hop.numerics for hop in route.hops] == [gpu, cpu]


def test_a_different_contract_never_mixes_even_with_equal_numerics():
    same = "llama-cpp-python 0.3.36; cpu; weight repack off"
    pool = [shard("a", 0, 9, numerics=same), shard("b", 9, 18, model=OTHER_RECIPE, numerics=same)]
    with pytest.raises(NoRouteError, match=r"layers \[9, 18\)"):
        plan_route(pool, GEMMA)


def test_gap_is_explained():
    with pytest.raises(NoRouteError) as info:
        plan_route([shard("a", 0, 6), shard("c", 12, 18)], GEMMA)
    assert "layers [6, 18)" in str(info.value)
    assert "[0,6), [12,18)" in str(info.value)


def test_plans_are_deterministic_under_ties():
    pool = [shard("a", 0, 9), shard("z", 9, 18), shard("m", 9, 18)]
    assert names(plan_route(pool, GEMMA)) == ["a", "m"]
    assert names(plan_route(list(reversed(pool)), GEMMA)) == ["a", "m"]
