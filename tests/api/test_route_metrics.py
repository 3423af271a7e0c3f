"""/metrics exports the expected time per token of each model's route and the slow-stage verdicts."""

from meshnode.head.candidates import shard_candidates
from meshnode.head.planner import ModelIdentity, plan_route
from meshnode.head.route_time import route_time
from meshnode.identity import short_id
from meshnode.mesh.slow_stage import LASTING_NS, SlowStageWatch, StageFigure
from meshnode.metrics import MetricSources, live_families, samples_by_name
from meshnode.wire.pb import mesh, shard

MODEL = ModelIdentity("sha256:aa", "sha256:r1", 4)


def node(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def announcement(name: str, start: int, end: int, decode_us: int = 0):
    served = mesh.ServedShard(
        model_name="m",
        fingerprint=shard.Fingerprint(model_artifact_digest="sha256:aa", runtime_recipe_digest="sha256:r1"),
        shard_range=shard.ShardRange(start_layer=start, end_layer=end),
        total_layers=4,
    )
    if decode_us:
        served.speed.CopyFrom(
            mesh.StageSpeed(decode_us_per_token=decode_us, source=mesh.STAGE_SPEED_SOURCE_MEASURED)
        )
    return node(name), mesh.PeerAnnouncement(endpoint_id=node(name), serving=served)


class Routes:
    def __init__(self, *announcements) -> None:
        self.candidates = shard_candidates(announcements)

    def route_times(self):
        return [route_time(plan_route(self.candidates, MODEL), self.candidates)]


def samples(sources: MetricSources):
    return samples_by_name(live_families(sources, None, now=0.0))


def test_the_routes_expected_seconds_per_token_by_model():
    timed = Routes(announcement("a", 0, 2, 10_000), announcement("b", 2, 4, 30_000))
    assert samples(MetricSources(routes=timed))["meshnode_route_expected_seconds_per_token"] == [
        ({"model": "m"}, 0.044)
    ]
    # A hop without a speed: the route's time is unknown, and not exported as a number.
    untimed = Routes(announcement("a", 0, 2, 10_000), announcement("b", 2, 4))
    assert samples(MetricSources(routes=untimed)).get("meshnode_route_expected_seconds_per_token") is None


def test_each_compared_stage_has_its_ratio_and_whether_it_is_slow():
    stages = [
        StageFigure(node("a"), ("sha256:aa", "sha256:r1", 6), 0, 2, 10.0, 2.0),
        StageFigure(node("b"), ("sha256:aa", "sha256:r1", 6), 2, 4, 10.0, 2.0),
        StageFigure(node("c"), ("sha256:aa", "sha256:r1", 6), 4, 6, 30.0, 2.0),
    ]
    watch = SlowStageWatch()
    watch.observe(0, stages)
    watch.observe(LASTING_NS, stages)
    found = samples(MetricSources(slow_stages=watch))
    assert found["meshnode_stage_time_ratio"] == [
        ({"node": short_id(node("a"))}, 0.5),
        ({"node": short_id(node("b"))}, 0.5),
        ({"node": short_id(node("c"))}, 3.0),
    ]
    assert found["meshnode_stage_slow"] == [
        ({"node": short_id(node("a"))}, 0),
        ({"node": short_id(node("b"))}, 0),
        ({"node": short_id(node("c"))}, 1),
    ]
