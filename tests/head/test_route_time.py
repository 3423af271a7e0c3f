"""A route's expected time per token is the sum of what its hops announce for the layers they run."""

import pytest

from meshnode.head.candidates import shard_candidates
from meshnode.head.planner import HOP_OVERHEAD_MS, ModelIdentity, plan_route
from meshnode.head.route_time import route_time
from meshnode.wire.pb import mesh, shard

GEMMA = ModelIdentity("sha256:aa", "sha256:r1", 18)


def node(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def announcement(name: str, start: int, end: int, decode_us: int = 0, prefill_us: int = 0):
    served = mesh.ServedShard(
        model_name="gemma-3-270m",
        fingerprint=shard.Fingerprint(model_artifact_digest="sha256:aa", runtime_recipe_digest="sha256:r1"),
        shard_range=shard.ShardRange(start_layer=start, end_layer=end),
        total_layers=18,
    )
    if decode_us:
        served.speed.CopyFrom(
            mesh.StageSpeed(
                decode_us_per_token=decode_us,
                prefill_us_per_token=prefill_us,
                source=mesh.STAGE_SPEED_SOURCE_MEASURED,
            )
        )
    return node(name), mesh.PeerAnnouncement(endpoint_id=node(name), serving=served)


def test_a_known_mesh_expects_the_sum_of_its_hops_announced_decode_and_link_times():
    candidates = shard_candidates(
        [
            announcement("a", 0, 6, decode_us=12_000, prefill_us=1_500),
            announcement("b", 6, 12, decode_us=30_000, prefill_us=4_000),
            announcement("c", 12, 18, decode_us=18_000, prefill_us=2_000),
        ]
    )
    route = plan_route(candidates, GEMMA)
    expected = route_time(route, candidates)
    assert [hop.decode_ms for hop in expected.hops] == [12.0, 30.0, 18.0]
    assert expected.decode_ms_per_token == pytest.approx(12.0 + 30.0 + 18.0 + 3 * HOP_OVERHEAD_MS)
    assert expected.prefill_ms_per_token == pytest.approx(1.5 + 4.0 + 2.0)
    # A whole answer: the prompt's prefill, then a step per token.
    assert expected.answer_ms(100, 20) == pytest.approx(100 * 7.5 + 20 * 66.0)
    assert expected.tokens_within(100 * 7.5 + 20 * 66.0, 100) == 20
    assert expected.tokens_within(100 * 7.5 + 20 * 66.0 - 1, 100) == 19
    assert expected.tokens_within(100 * 7.5, 100) == 0


def test_a_hop_entered_mid_range_counts_only_the_layers_it_runs():
    # "b" serves [4, 12) but the route enters it at 6, after "a": 6 of its 8 layers.
    candidates = shard_candidates(
        [
            announcement("a", 0, 6, decode_us=10_000),
            announcement("b", 4, 12, decode_us=40_000),
            announcement("c", 12, 18, decode_us=10_000),
        ]
    )
    route = plan_route(candidates, GEMMA)
    expected = route_time(route, candidates)
    assert [(hop.start_layer, hop.end_layer) for hop in expected.hops] == [(0, 6), (6, 12), (12, 18)]
    assert expected.hops[1].decode_ms == pytest.approx(30.0)
    assert expected.decode_ms_per_token == pytest.approx(10.0 + 30.0 + 10.0 + 3 * HOP_OVERHEAD_MS)


def test_a_hop_that_announces_no_speed_leaves_the_route_time_unknown():
    candidates = shard_candidates([announcement("a", 0, 9, decode_us=10_000), announcement("b", 9, 18)])
    expected = route_time(plan_route(candidates, GEMMA), candidates)
    assert expected.decode_ms_per_token is None
    assert expected.unannounced == (node("b"),)
    assert expected.answer_ms(10, 10) is None
    assert expected.tokens_within(1_000.0, 10) is None
    assert expected.to_json()["decode_ms_per_token"] is None


def test_the_status_json_names_each_hop_and_the_route_figures():
    candidates = shard_candidates(
        [announcement("a", 0, 9, decode_us=8_000), announcement("b", 9, 18, decode_us=10_000)]
    )
    shown = route_time(plan_route(candidates, GEMMA), candidates).to_json()
    assert shown["model"] == "gemma-3-270m"
    assert shown["decode_ms_per_token"] == 22.0
    assert shown["tokens_per_s"] == round(1000 / 22.0, 2)
    assert [hop["layers"] for hop in shown["hops"]] == [[0, 9], [9, 18]]
    assert [hop["decode_ms"] for hop in shown["hops"]] == [8.0, 10.0]
