"""A stage far slower than the others for the work it holds is told so, only once it lasts."""

import pytest

from meshnode.mesh.slow_stage import (
    LASTING_NS,
    SlowStageWatch,
    StageFigure,
    stage_figures,
    stage_ratios,
)
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh, shard

GEMMA = ("sha256:aa", "sha256:r1", 18)
OTHER = ("sha256:bb", "sha256:r1", 18)


def node(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def stage(name: str, start: int, end: int, decode_ms: float, model=GEMMA, work: float | None = None):
    return StageFigure(node(name), model, start, end, decode_ms, float(end - start) if work is None else work)


def mesh_with(slow_ms: float) -> list[StageFigure]:
    """Three stages of six layers; "c" takes ``slow_ms`` where the others take 12 ms."""
    return [stage("a", 0, 6, 12.0), stage("b", 6, 12, 12.0), stage("c", 12, 18, slow_ms)]


def test_each_stage_is_compared_per_layer_with_the_median_of_the_others_of_its_model():
    ratios = stage_ratios(
        [
            stage("a", 0, 4, 8.0),  # 2 ms a layer
            stage("b", 4, 12, 16.0),  # 2 ms a layer: more layers, same speed
            stage("c", 12, 18, 36.0),  # 6 ms a layer
            stage("x", 0, 18, 500.0, model=OTHER),  # another model's only stage: not compared
        ]
    )
    assert set(ratios) == {node("a"), node("b"), node("c")}
    assert ratios[node("c")].ratio == pytest.approx(3.0)
    assert ratios[node("c")].compared_with == 2
    # Against the median of "b" (2) and "c" (6): 4.
    assert ratios[node("a")].ratio == pytest.approx(0.5)


def test_the_work_a_range_holds_can_price_the_output_projection_at_the_last_stage():
    # The last stage reads its layers and the vocabulary's projection: by layers it looks 4x slow,
    # by the bytes a step reads it is as fast as the others.
    by_layers = stage_ratios([stage("a", 0, 9, 9.0), stage("b", 9, 18, 36.0)])
    assert by_layers[node("b")].ratio == pytest.approx(4.0)
    by_bytes = stage_ratios([stage("a", 0, 9, 9.0, work=9.0), stage("b", 9, 18, 36.0, work=36.0)])
    assert by_bytes[node("b")].ratio == pytest.approx(1.0)


def test_a_short_lived_slowdown_makes_no_verdict():
    watch = SlowStageWatch()
    now = 0
    assert watch.observe(now, mesh_with(12.0)) == []
    # Three times slower for 59 s, then back to the others' pace.
    for _ in range(59):
        now += SECOND_NS
        assert watch.observe(now, mesh_with(36.0)) == []
    assert watch.verdict(node("c")).pending_since_ns == SECOND_NS
    now += SECOND_NS
    assert watch.observe(now, mesh_with(12.0)) == []
    assert not watch.is_slow(node("c"))
    assert watch.verdict(node("c")).pending_since_ns is None
    # A new slowdown starts the count again.
    now += SECOND_NS
    watch.observe(now, mesh_with(36.0))
    now += LASTING_NS - SECOND_NS
    assert watch.observe(now, mesh_with(36.0)) == []
    assert watch.slow_nodes() == frozenset()


def test_a_lasting_slowdown_is_told_and_cleared_only_once_it_lasts_below_the_clearing_ratio():
    watch = SlowStageWatch()
    start = 5 * SECOND_NS
    watch.observe(start, mesh_with(36.0))
    assert watch.observe(start + LASTING_NS - 1, mesh_with(36.0)) == []
    (became,) = watch.observe(start + LASTING_NS, mesh_with(36.0))
    assert (became.node_id, became.slow, became.ratio) == (node("c"), True, pytest.approx(3.0))
    assert watch.is_slow(node("c")) and not watch.is_slow(node("a"))
    assert watch.slow_nodes() == frozenset({node("c")})
    # 1.8x is under the slow ratio but over the clearing one: still slow, however long.
    later = start + LASTING_NS
    for _ in range(3):
        later += LASTING_NS
        assert watch.observe(later, mesh_with(21.6)) == []
    assert watch.is_slow(node("c"))
    # Back near the others' pace: cleared once that lasts.
    later += SECOND_NS
    watch.observe(later, mesh_with(13.0))
    assert watch.observe(later + LASTING_NS - 1, mesh_with(13.0)) == []
    (cleared,) = watch.observe(later + LASTING_NS, mesh_with(13.0))
    assert (cleared.node_id, cleared.slow) == (node("c"), False)
    assert watch.verdict(node("c")).to_json(later + LASTING_NS + 2 * SECOND_NS)["since_s"] == 2.0


def test_a_stage_no_longer_compared_is_forgotten():
    watch = SlowStageWatch()
    watch.observe(0, mesh_with(36.0))
    watch.observe(LASTING_NS, mesh_with(36.0))
    assert watch.is_slow(node("c"))
    watch.observe(LASTING_NS + SECOND_NS, mesh_with(36.0)[:2])
    assert watch.verdict(node("c")) is None and not watch.is_slow(node("c"))


def test_the_clearing_ratio_must_sit_between_one_and_the_slow_ratio():
    with pytest.raises(ValueError):
        SlowStageWatch(slow_ratio=2.0, clear_ratio=2.5)
    with pytest.raises(ValueError):
        SlowStageWatch(clear_ratio=1.0)


def served(start: int, end: int, decode_us: int = 0) -> mesh.ServedShard:
    shard_served = mesh.ServedShard(
        model_name="gemma-3-270m",
        fingerprint=shard.Fingerprint(model_artifact_digest="sha256:aa", runtime_recipe_digest="sha256:r1"),
        shard_range=shard.ShardRange(start_layer=start, end_layer=end),
        total_layers=18,
    )
    if decode_us:
        shard_served.speed.CopyFrom(
            mesh.StageSpeed(decode_us_per_token=decode_us, source=mesh.STAGE_SPEED_SOURCE_MEASURED)
        )
    return shard_served


def test_figures_come_from_the_stages_that_announce_a_speed_and_take_sessions():
    timed = mesh.PeerAnnouncement(serving=served(0, 6, 12_000))
    untimed = mesh.PeerAnnouncement(serving=served(6, 12))
    draining = mesh.PeerAnnouncement(serving=served(12, 18, 90_000))
    draining.load.serving_state = shard.SERVING_STATE_DRAINING
    nothing = mesh.PeerAnnouncement()
    figures = stage_figures(
        [(node("a"), timed), (node("b"), untimed), (node("c"), draining), (node("d"), nothing)]
    )
    assert figures == [stage("a", 0, 6, 12.0)]
    doubled = stage_figures([(node("a"), timed)], work=lambda model, start, end: 2.0 * (end - start))
    assert doubled[0].work == 12.0 and doubled[0].model == GEMMA
