"""Placement by time over real nodes and real transfers, with the shard service left out.

The creator serves the whole tiny model (six layers) and announces 1 ms a layer; a joiner
places itself. By time, a joiner stated to be a third as fast takes the one layer that makes
the best route fastest (its 3 ms, then the creator's five layers, 5 ms, against 6 ms for
the creator alone); by memory, or with no speed of its own, it takes the four layers its
budget holds, as before. Once serving, the joiner's shard measures itself as fast as the
creator, and the joiner moves, after the settle time, to the three layers that split the
work evenly. Joiners placing at once price each other by the estimates their claims announce,
and a joiner told nothing of its speed probes a middle layer before it claims.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually
from served_speeds import announce, speed_for

from engines.gguf_file import read_gguf
from engines.model_manifest import build_manifest
from engines.slicing import tensors_for_range
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.artifacts.holdings import FullModel, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.autoplace.auto_shard import AutoPlaceConfig, AutoShard, ServeRequest
from meshnode.autoplace.time_balance import TimedRange, route_bottleneck
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.node import Node

pytestmark = pytest.mark.timeout(90)

CREATOR_US_PER_LAYER = 1_000


class MeasuredShard:
    """Serving as gossip sees it, announcing the speed its range measured."""

    def __init__(self, node: Node, request: ServeRequest, us_per_layer: int) -> None:
        self.node = node
        self.speed = speed_for(request.layers, us_per_layer)
        announce(node, request.fingerprint, request.layers, self.speed)

    async def drain(self) -> None:
        pass

    async def aclose(self) -> None:
        self.node.set_serving(None)


def budget_for(model: Path) -> int:
    """Four ordinary layers and one vocabulary table, not a fifth layer."""
    sizes = {t.name: t.nbytes for t in read_gguf(model).tensors}
    return (
        4 * sum(size for name, size in sizes.items() if name.startswith("blk.1."))
        + sizes["output.weight"]
        + 4096
    )


@contextlib.asynccontextmanager
async def placing(
    tmp_path: Path,
    node: Node,
    model: Path,
    *,
    place_by: str,
    estimate: float | None,
    measured_us: int,
    probe: Callable[[ServeRequest], Awaitable[StageSpeed | None]] | None = None,
    claim_settle_s: float = 1.0,
) -> AsyncIterator[AutoShard]:
    holdings = Holdings()
    ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(node)
    settings = AutoPlaceConfig(
        store_dir=tmp_path / f"store-{node.node_id.hex()[:8]}",
        memory_budget=budget_for(model),
        poll_s=0.1,
        claim_settle_s=claim_settle_s,
        move_settle_s=0.5,
        place_by=place_by,
        speed_estimate=estimate,
    )
    shards: list[MeasuredShard] = []

    async def start_serving(request: ServeRequest) -> MeasuredShard:
        shards.append(MeasuredShard(node, request, measured_us))
        return shards[-1]

    def own_speed() -> StageSpeed | None:
        return shards[-1].speed if shards and placement.serving is shards[-1] else None

    placement = AutoShard(node, settings, start_serving, holdings, own_speed=own_speed, probe=probe)
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


@contextlib.asynccontextmanager
async def creator_and_joiner(tmp_path: Path) -> AsyncIterator[tuple[Path, Node, Node]]:
    model = ensure_tiny_model()
    creator = await start_first_node(tmp_path)
    joiner: Node | None = None
    try:
        whole = (0, TINY_N_LAYERS)
        announce(creator, build_manifest(model).root, whole, speed_for(whole, CREATOR_US_PER_LAYER))
        holdings = Holdings()
        holdings.add(FullModel(model))
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(creator)
        joiner = await start_joiner(tmp_path, "j", creator)
        await eventually(lambda: joiner.peers(), what="the joiner sees the creator")
        yield model, creator, joiner
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await creator.shutdown()


@pytest.mark.parametrize(
    ("place_by", "estimate", "expected", "placed_by"),
    [
        ("time", 1 / 3, (0, 1), "time"),
        # Memory-only, or no speed of its own: the four layers its budget holds, as before.
        ("memory", 1 / 3, (0, 4), "memory"),
        ("time", None, (0, 4), "memory"),
    ],
)
async def test_a_joiner_a_third_as_fast_takes_fewer_layers_by_time_and_its_budget_by_memory(
    tmp_path, place_by: str, estimate: float | None, expected: tuple[int, int], placed_by: str
):
    async with (
        creator_and_joiner(tmp_path) as (model, _, joiner),
        placing(
            tmp_path,
            joiner,
            model,
            place_by=place_by,
            estimate=estimate,
            measured_us=3 * CREATOR_US_PER_LAYER,
        ) as placement,
    ):
        await eventually(lambda: placed(placement), timeout=30, what="placed")
        assert placed(placement) == expected
        status = placement.status()
        assert status["place_by"] == place_by
        assert status["placed_by"] == placed_by


async def test_a_joiner_that_measures_itself_faster_than_stated_moves_to_more_layers(tmp_path):
    moves: list[tuple[int, int]] = []

    def seen(placement: AutoShard) -> Callable[[], bool]:
        def check() -> bool:
            layers = placed(placement)
            if layers is not None and (not moves or moves[-1] != layers):
                moves.append(layers)
            return layers == (0, 3)

        return check

    async with (
        creator_and_joiner(tmp_path) as (model, _, joiner),
        placing(
            tmp_path, joiner, model, place_by="time", estimate=1 / 3, measured_us=CREATOR_US_PER_LAYER
        ) as placement,
    ):
        await eventually(seen(placement), timeout=30, what="the move to an even split")
        # Stated a third as fast, it first took one layer; measured as fast as the creator, it
        # moved to three (3 ms and the creator's 3 ms, against 1 ms and 5 ms).
        assert moves[0] == (0, 1)
        assert placement.status()["own_speed"] == {
            "source": "measured",
            "decode_ms_per_layer": 1.0,
            "estimate": 1 / 3,
        }


async def test_two_joiners_placing_at_once_price_each_other_by_the_speed_their_claims_announce(tmp_path):
    """A joiner as fast as the creator and one a third as fast place themselves at the same moment.
    Each claim announces its estimate, so the later chooser prices the earlier's claim by time
    (without it, it would have chosen by memory), and the best route ends at 3 ms, the best
    six layers allow (2.6 ms split exactly)."""
    model = ensure_tiny_model()
    async with creator_and_joiner(tmp_path) as (_, creator, fast):
        slow = await start_joiner(tmp_path, "slow", creator)
        await eventually(lambda: len(slow.peers()) == 2 and len(fast.peers()) == 2, what="a full mesh")
        async with (
            placing(
                tmp_path, fast, model, place_by="time", estimate=1.0, measured_us=CREATOR_US_PER_LAYER
            ) as fast_placement,
            placing(
                tmp_path, slow, model, place_by="time", estimate=1 / 3, measured_us=3 * CREATOR_US_PER_LAYER
            ) as slow_placement,
        ):
            await eventually(
                lambda: placed(fast_placement) and placed(slow_placement), timeout=30, what="both placed"
            )
            fast_layers, slow_layers = placed(fast_placement), placed(slow_placement)
            assert fast_layers is not None and slow_layers is not None
            stages = [
                TimedRange((0, TINY_N_LAYERS), CREATOR_US_PER_LAYER),
                TimedRange(fast_layers, CREATOR_US_PER_LAYER),
                TimedRange(slow_layers, 3 * CREATOR_US_PER_LAYER),
            ]
            assert route_bottleneck(TINY_N_LAYERS, stages) == 3 * CREATOR_US_PER_LAYER, stages
            # The fast joiner's claim keeps its range against the slow one's whatever their ids
            # (claim_keeps: three times as fast), so it chose seeing the creator's speed and its
            # own: by time. (The slow one, pricing the fast one's claim, takes a range by time
            # where one gains, else by memory.)
            assert fast_placement.status()["placed_by"] == "time"
        await slow.shutdown()


async def test_a_faster_joiner_takes_a_gap_a_slower_one_with_a_lower_id_claimed_first(tmp_path):
    """The creator serves layers [0, 2) of six; a joiner a third as fast, with the lower node id,
    claims the gap [2, 6) first (nothing else covers it), then a joiner as fast as the creator
    chooses. By node id alone the fast one would yield and the slow one would hold four layers
    (12 ms, the route's pace, since a hop runs to its range's end no later move can relieve it);
    by speed the faster claim keeps the gap, the slow one yields, and the route runs at 4 ms at
    most."""
    model = ensure_tiny_model()
    creator = await start_first_node(tmp_path)
    joiners: list[Node] = []
    try:
        head = (0, 2)
        announce(creator, build_manifest(model).root, head, speed_for(head, CREATOR_US_PER_LAYER))
        holdings = Holdings()
        holdings.add(FullModel(model))
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(creator)
        joiners = [await start_joiner(tmp_path, name, creator) for name in ("j1", "j2")]
        slow, fast = sorted(joiners, key=lambda node: node.node_id)
        await eventually(lambda: len(slow.peers()) == 2 and len(fast.peers()) == 2, what="a full mesh")
        async with placing(
            tmp_path, slow, model, place_by="time", estimate=1 / 3,
            measured_us=3 * CREATOR_US_PER_LAYER, claim_settle_s=5.0,
        ) as slow_placement:  # fmt: skip
            await eventually(
                lambda: slow_placement.status()["state"] == "claiming"
                and any(entry.peer_id == slow.node_id and entry.announcement.HasField("serving")
                        for entry in fast.peers()),
                what="the slow joiner's claim seen by the fast one",
            )  # fmt: skip
            first_claim = slow_placement.layers
            async with placing(
                tmp_path, fast, model, place_by="time", estimate=1.0,
                measured_us=CREATOR_US_PER_LAYER, claim_settle_s=5.0,
            ) as fast_placement:  # fmt: skip
                await eventually(
                    lambda: placed(fast_placement) and placed(slow_placement), timeout=60, what="both placed"
                )
                fast_layers, slow_layers = placed(fast_placement), placed(slow_placement)
                assert fast_layers is not None and slow_layers is not None
        assert first_claim == (2, 6)
        assert fast_layers == (2, 6)
        stages = [
            TimedRange(head, CREATOR_US_PER_LAYER),
            TimedRange(fast_layers, CREATOR_US_PER_LAYER),
            TimedRange(slow_layers, 3 * CREATOR_US_PER_LAYER),
        ]
        # The fast one's four layers, or a route through one layer of the slow one's (3 ms).
        assert route_bottleneck(TINY_N_LAYERS, stages) <= 4 * CREATOR_US_PER_LAYER, stages
    finally:
        for joiner in joiners:
            await joiner.shutdown()
        await creator.shutdown()


@pytest.mark.parametrize("place_by", ["time", "memory"])
async def test_a_joiner_with_no_speed_of_its_own_probes_a_middle_layer_before_it_claims(
    tmp_path, place_by: str
):
    probed: list[ServeRequest] = []

    async def probe(request: ServeRequest) -> StageSpeed:
        # What a real probe returns: the speed a shard of the slice calibrated at load.
        probed.append(request)
        return speed_for(request.layers, 3 * CREATOR_US_PER_LAYER)

    async with (
        creator_and_joiner(tmp_path) as (model, _, joiner),
        placing(
            tmp_path,
            joiner,
            model,
            place_by=place_by,
            estimate=None,
            measured_us=3 * CREATOR_US_PER_LAYER,
            probe=probe,
        ) as placement,
    ):
        await eventually(lambda: placed(placement), timeout=30, what="placed")
        if place_by == "memory":
            assert probed == [] and placed(placement) == (0, 4)
            return
        # Probed a third as fast as the creator: one layer, as if it had been told so.
        assert [request.layers for request in probed] == [(3, 4)]
        assert placed(placement) == (0, 1)
        assert placement.status()["own_speed"]["source"] in {"probed", "measured"}
        # The probe's layer was fetched and verified like any range's.
        held = placement._store.reopen(build_manifest(model).root)
        assert held is not None
        assert tensors_for_range(read_gguf(model), 3, 4) <= held.verified
        held.close()
