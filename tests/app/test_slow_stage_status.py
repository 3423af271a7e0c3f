"""A node that slows everyone down is told so in its status and log, and on its head's routes:
three in-process nodes over real QUIC, each announcing a speed in its signed record; the
verdicts' clock is synthetic (the monitor is observed at chosen times).

The model has six layers, two a node: "a" and "b" take 10 ms for theirs, "c" 40 ms, four times
the others' time per layer.
"""

import logging
import time

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.app.head_service import route_status
from meshnode.app.slow_stage_status import SLOW_STAGE_SECTION, SlowStageMonitor
from meshnode.app.status import format_status
from meshnode.head.driver import GenerationDriver
from meshnode.head.environment import NodeRoutes
from meshnode.head.local_link import LocalShardLink
from meshnode.head.planner import HOP_OVERHEAD_MS
from meshnode.head.route_backend import LocalModel, RouteBackend
from meshnode.mesh.slow_stage import LASTING_NS
from meshnode.node import Node
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh, shard

pytestmark = pytest.mark.timeout(60)

ARTIFACT = "sha256:" + "ab" * 32


def serve(node: Node, start: int, end: int, decode_us: int) -> None:
    node.set_serving(
        mesh.ServedShard(
            model_name="m",
            fingerprint=shard.Fingerprint(model_artifact_digest=ARTIFACT, runtime_recipe_digest="sha256:r1"),
            shard_range=shard.ShardRange(start_layer=start, end_layer=end),
            total_layers=6,
            speed=mesh.StageSpeed(
                decode_us_per_token=decode_us, samples=30, source=mesh.STAGE_SPEED_SOURCE_MEASURED
            ),
        )
    )


@pytest.fixture
async def three_nodes(tmp_path):
    a = await start_first_node(tmp_path)
    nodes = [a]
    try:
        nodes.append(await start_joiner(tmp_path, "b", a))
        nodes.append(await start_joiner(tmp_path, "c", a))
        for node, (start, end, decode_us) in zip(
            nodes, [(0, 2, 10_000), (2, 4, 10_000), (4, 6, 40_000)], strict=True
        ):
            serve(node, start, end, decode_us)
        c = nodes[2]

        def c_sees_both():
            return sum(1 for entry in c.peers() if entry.announcement.serving.speed.decode_us_per_token) == 2

        await eventually(c_sees_both)
        yield nodes
    finally:
        for node in nodes:
            await node.shutdown()


class Clock:
    def __init__(self) -> None:
        self.now_ns = time.monotonic_ns()

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, ns: int) -> int:
        self.now_ns += ns
        return self.now_ns


async def test_a_lasting_slowdown_is_in_the_nodes_status_and_log_and_on_its_heads_route(three_nodes, caplog):
    _, _, c = three_nodes
    clock = Clock()
    monitor = SlowStageMonitor(c, clock=clock)
    c.add_status_section(SLOW_STAGE_SECTION, monitor.status)
    local = LocalShardLink(c.node_id)
    backend = RouteBackend(GenerationDriver(NodeRoutes(c, local)), [LocalModel("m", ARTIFACT, None)])  # type: ignore[arg-type]  # no tokenizer is read
    c.add_status_section("routes", lambda: route_status(backend, monitor.watch))
    caplog.set_level(logging.INFO, logger="meshnode.app.slow_stage_status")
    try:
        assert monitor.observe(clock()) == []
        # Not yet lasting: over the threshold, pending, not slow.
        assert monitor.observe(clock.advance(LASTING_NS - SECOND_NS)) == []
        section = c.status().to_json()["sections"][SLOW_STAGE_SECTION]
        own = section["this_node"]
        assert (own["node"], own["slow"], own["ratio"], own["compared_with"]) == (
            c.identity.short_id,
            False,
            4.0,
            2,
        )
        assert own["pending_s"] == 59.0
        assert section["slow"] == []
        assert not caplog.records

        (verdict,) = monitor.observe(clock.advance(SECOND_NS))
        clock.advance(2 * SECOND_NS)
        assert verdict.node_id == c.node_id and verdict.slow
        status = c.status().to_json()
        section = status["sections"][SLOW_STAGE_SECTION]
        assert section["this_node"]["slow"] is True
        assert [slow["node"] for slow in section["slow"]] == [c.identity.short_id]
        assert (section["slow_ratio"], section["clear_ratio"], section["lasting_s"]) == (2.0, 1.5, 60.0)
        (warning,) = [record for record in caplog.records if record.levelno == logging.WARNING]
        assert "this node's stage has taken 4.0x the other stages' time for its layers for 60 s" in (
            warning.getMessage()
        )

        # The head's route: the sum of the hops' announced times, its slow hop marked.
        (route,) = status["sections"]["routes"]["routes"]
        assert route["model"] == "m"
        assert route["decode_ms_per_token"] == pytest.approx(10 + 10 + 40 + 3 * HOP_OVERHEAD_MS)
        assert [(hop["layers"], hop["decode_ms"], hop["slow"]) for hop in route["hops"]] == [
            ([0, 2], 10.0, False),
            ([2, 4], 10.0, False),
            ([4, 6], 40.0, True),
        ]
        text = format_status(status)
        assert "this node's stage: 4.0x the other stages' time for its layers, slow for 2 s" in text
        assert "route for m: 66.0 ms/token expected (15.2 tokens/s): " in text
        assert f"{c.identity.short_id} [4,6) 40.0 ms SLOW" in text
    finally:
        await local.aclose()


async def test_a_short_lived_slowdown_leaves_no_verdict_and_no_log(three_nodes, caplog):
    _, _, c = three_nodes
    monitor = SlowStageMonitor(c)
    start = time.monotonic_ns()
    caplog.set_level(logging.INFO, logger="meshnode.app.slow_stage_status")
    monitor.observe(start)
    # "c" recovers: it announces the others' pace before the slowdown lasted.
    serve(c, 4, 6, 10_000)
    assert monitor.observe(start + LASTING_NS) == []
    assert monitor.status()["this_node"]["slow"] is False
    assert monitor.status()["this_node"]["pending_s"] is None
    assert not caplog.records


def test_status_text_of_a_pending_verdict_another_slow_stage_and_a_route_of_unknown_time():
    node = {
        "short_id": "aaaa",
        "mesh_id": "m1",
        "member": True,
        "addresses": ["127.0.0.1:1"],
        "serving": None,
    }
    verdict = {"compared_with": 2, "since_s": None}
    sections = {
        "slow_stages": {
            "this_node": {**verdict, "node": "aaaa", "slow": False, "ratio": 2.4, "pending_s": 12.0},
            "slow": [
                {**verdict, "node": "cccc", "slow": True, "ratio": 3.0, "pending_s": None, "since_s": 90.0}
            ],
            "slow_ratio": 2.0,
            "clear_ratio": 1.5,
            "lasting_s": 60.0,
        },
        "routes": {
            "routes": [
                {
                    "model": "m",
                    "decode_ms_per_token": None,
                    "tokens_per_s": None,
                    "hops": [
                        {"node": "aaaa", "layers": [0, 3], "decode_ms": 10.0, "link_ms": 2.0, "slow": False},
                        {"node": "bbbb", "layers": [3, 6], "decode_ms": None, "link_ms": 2.0, "slow": False},
                    ],
                }
            ]
        },
    }
    lines = format_status({"node": node, "peers": [], "sections": sections}).splitlines()
    assert (
        "  this node's stage: 2.4x the other stages' time for its layers (over 2x for 12 of 60 s before it "
        "is called slow)"
    ) in lines
    assert (
        "  slow stage: node cccc, 3.0x the other stages' time for its layers, slow for 90 s: every route "
        "through it runs at its pace"
    ) in lines
    assert (
        "  route for m: time unknown (a hop announces no speed): aaaa [0,3) 10.0 ms, bbbb [3,6) unannounced"
    ) in lines
