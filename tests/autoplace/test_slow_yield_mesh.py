"""A slow node gives up the layers a faster replica serves, over real nodes, gossip and transfers.

The creator serves layers [0, 3) of the tiny model (six layers) at 1 ms a layer. A joiner that
states itself as fast places itself by time on the other three, [3, 6), then measures 3 ms a
layer: its stage is found slow (:class:`meshnode.app.slow_stage_status.SlowStageMonitor`, three
times the others' time), but it alone serves its layers, so it keeps them. Then a fast node
starts serving [3, 5): the slow node gives those two layers up and serves [5, 6) alone, where
placement by time leaves it. With ``--no-slow-yield``, or placing by memory, it keeps its range.
No placement by time moves it otherwise: the best route already runs the fast node's [3, 5).

Time is a clock the test owns, one second a reading, shared by the verdicts and the placement's
settle times: what decides is how many times each looked, not how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually
from served_speeds import announce, speed_for

from engines.model_manifest import build_manifest
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.app.slow_stage_status import SlowStageMonitor
from meshnode.artifacts.holdings import FullModel, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.autoplace.auto_shard import AutoPlaceConfig, AutoShard, ServeRequest
from meshnode.autoplace.mesh_models import MeshModel, coverage
from meshnode.autoplace.time_balance import TimedRange, route_bottleneck
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.identity import short_id
from meshnode.mesh.placement import replica_counts
from meshnode.mesh.slow_stage import SlowStageWatch
from meshnode.node import Node
from meshnode.sansio import SECOND_NS

pytestmark = pytest.mark.timeout(120)

FAST_US_PER_LAYER = 1_000
SLOW_US_PER_LAYER = 3 * FAST_US_PER_LAYER


class SteppingClock:
    """Monotonic ns that advance one second at each reading."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        self.now_ns += SECOND_NS
        return self.now_ns


def announce_measured(node: Node, root: str, layers: tuple[int, int], us_per_layer: int) -> None:
    announce(node, root, layers, speed_for(layers, us_per_layer, measured=True))


class MeasuredShard:
    """Serving as gossip sees it: the range, at the speed this machine measures for it."""

    def __init__(self, node: Node, request: ServeRequest) -> None:
        self.node = node
        self.speed = speed_for(request.layers, SLOW_US_PER_LAYER, measured=True)
        announce_measured(node, request.fingerprint, request.layers, SLOW_US_PER_LAYER)

    async def drain(self) -> None:
        pass

    async def aclose(self) -> None:
        self.node.set_serving(None)


@contextlib.asynccontextmanager
async def slow_node_placing(
    tmp_path, node: Node, clock: SteppingClock, *, place_by: str, slow_yield: bool
) -> AsyncIterator[AutoShard]:
    """The slow node's placement, stated as fast as the creator, and its slow-stage verdicts."""
    holdings = Holdings()
    ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(node)
    monitor = SlowStageMonitor(node, SlowStageWatch(lasting_ns=3 * SECOND_NS), clock=clock)
    settings = AutoPlaceConfig(
        store_dir=tmp_path / "store-slow",
        memory_budget=None,
        poll_s=0.1,
        claim_settle_s=1.0,
        move_settle_s=5.0,
        place_by=place_by,
        speed_estimate=1.0,
        slow_yield=slow_yield,
    )
    shards: list[MeasuredShard] = []

    async def start_serving(request: ServeRequest) -> MeasuredShard:
        shards.append(MeasuredShard(node, request))
        return shards[-1]

    def own_speed() -> StageSpeed | None:
        return shards[-1].speed if shards and placement.serving is shards[-1] else None

    placement = AutoShard(
        node,
        settings,
        start_serving,
        holdings,
        # Every layer fits: by memory the node takes all six, by time the three nobody serves.
        budget=lambda: 1 << 40,
        own_speed=own_speed,
        is_slow=lambda: monitor.watch.is_slow(node.node_id),
        clock=clock,
    )
    async with monitor.watching(interval_s=0.05):
        task = asyncio.ensure_future(placement.run())
        try:
            yield placement
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await placement.aclose()


def placed(placement: AutoShard) -> tuple[int, int] | None:
    return placement.layers if placement.status()["state"] == "serving" else None


@pytest.mark.parametrize(
    ("place_by", "slow_yield", "first", "last"),
    [
        ("time", True, (3, 6), (5, 6)),
        # Told not to, or placing by memory: it keeps its range.
        ("time", False, (3, 6), (3, 6)),
        ("memory", True, (0, TINY_N_LAYERS), (0, TINY_N_LAYERS)),
    ],
)
async def test_a_slow_node_gives_up_to_a_faster_replica_the_layers_it_serves_and_keeps_the_rest(
    tmp_path, caplog, place_by: str, slow_yield: bool, first: tuple[int, int], last: tuple[int, int]
):
    caplog.set_level(logging.INFO, logger="meshnode.autoplace.auto_shard")
    model_path = ensure_tiny_model()
    root = build_manifest(model_path).root
    model = MeshModel(root, "tiny", TINY_N_LAYERS)
    clock = SteppingClock()
    creator = await start_first_node(tmp_path)
    joiners: list[Node] = []
    try:
        announce_measured(creator, root, (0, 3), FAST_US_PER_LAYER)
        holdings = Holdings()
        holdings.add(FullModel(model_path))
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(creator)
        slow = await start_joiner(tmp_path, "slow", creator)
        joiners.append(slow)
        fast = await start_joiner(tmp_path, "fast", creator)
        joiners.append(fast)
        await eventually(lambda: len(slow.peers()) == 2 and len(fast.peers()) == 2, what="a full mesh")
        seen: list[tuple[int, int]] = []

        def note(placement: AutoShard) -> tuple[int, int] | None:
            layers = placed(placement)
            if layers is not None and (not seen or seen[-1] != layers):
                seen.append(layers)
            return layers

        async with slow_node_placing(tmp_path, slow, clock, place_by=place_by, slow_yield=slow_yield) as p:
            await eventually(lambda: note(p), timeout=30, what="the slow node placed")
            assert seen == [first]
            # Its stage is slow (3 ms a layer against the creator's 1), but it alone serves its
            # layers: no yield, however long it looks.
            looked = clock.now_ns
            await eventually(lambda: note(p) and clock.now_ns > looked + 60 * SECOND_NS, what="a minute")
            assert seen == [first]
            if place_by == "time":
                assert p.status()["slow_yield"]["slow"] is True

            announce_measured(fast, root, (3, 5), FAST_US_PER_LAYER)
            await eventually(
                lambda: any(e.peer_id == fast.node_id and e.announcement.HasField("serving") for e in slow.peers()),
                what="the fast node's range seen by the slow one",
            )  # fmt: skip
            if first != last:
                await eventually(lambda: note(p) == last, timeout=30, what="the slow node's yield")
            # No move back (nor any other) while the fast node serves [3, 5).
            looked = clock.now_ns
            await eventually(lambda: note(p) and clock.now_ns > looked + 200 * SECOND_NS, what="a while")
            assert seen == ([first] if first == last else [first, last])
            status = p.status()["slow_yield"]
            assert status["enabled"] is slow_yield

            # Every layer is still served, the fast node's two among them, and the best route runs them.
            found = coverage(
                [(e.peer_id, e.announcement) for e in creator.peers()], model, exclude=creator.node_id
            )
            served = dict(found.served)
            assert served == {slow.node_id: last, fast.node_id: (3, 5)}
            assert min(replica_counts(TINY_N_LAYERS, [(0, 3), *served.values()])) >= 1
            stages = [
                TimedRange((0, 3), FAST_US_PER_LAYER),
                TimedRange((3, 5), FAST_US_PER_LAYER),
                TimedRange(last, SLOW_US_PER_LAYER),
            ]
            assert route_bottleneck(TINY_N_LAYERS, stages) == 3 * FAST_US_PER_LAYER

        if first == last:
            assert "giving up layers" not in caplog.text
            assert "last" not in status
            return
        assert status["last"]["given_up"] == [[3, 5]]
        assert status["last"]["faster_nodes"] == [short_id(fast.node_id)]
        assert status["last"]["to"] == [5, 6]
        expected = (
            f"stage 3.00 ms/layer vs median 1.00; layers [3, 5) served faster by node "
            f"{short_id(fast.node_id)}; now serving [5, 6)"
        )
        assert status["last"]["reason"] == expected
        assert expected in caplog.text
        assert "moving from layers [3, 6) to [5, 6): giving up layers faster replicas serve" in caplog.text
    finally:
        for joiner in joiners:
            await joiner.shutdown()
        await creator.shutdown()
