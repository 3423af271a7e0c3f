"""Placement's steps over real nodes and real transfers, with the shard service left out.

Three in-process nodes on real QUIC and the tiny model: the creator serves [0, 2) and
offers the whole file; two nodes place themselves at the same moment. Serving is a
stand-in that announces the range the way a shard service does, so what is tested is
placement's own part: the claims, the tie-break, the fetch of exactly a range's tensors,
and the move when a node leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually
from served_speeds import announce

from engines.gguf_file import read_gguf
from engines.model_manifest import build_manifest
from engines.slicing import tensors_for_range
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.artifacts.holdings import FullModel, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.autoplace.auto_shard import AutoPlaceConfig, AutoShard, ServeRequest
from meshnode.node import Node

pytestmark = pytest.mark.timeout(90)

CREATOR_LAYERS = (0, 2)


class AnnouncedShard:
    """Serving as gossip sees it: the range announced with a recipe, in the serving state."""

    def __init__(
        self, node: Node, request: ServeRequest, on_drain: Callable[[], None] = lambda: None
    ) -> None:
        self.node = node
        self.request = request
        self._on_drain = on_drain
        announce(node, request.fingerprint, request.layers)

    async def drain(self) -> None:
        self._on_drain()

    async def aclose(self) -> None:
        self.node.set_serving(None)


def budget_for(model: Path) -> int:
    """Four ordinary layers and one vocabulary table, not a fifth layer."""
    header = read_gguf(model)
    sizes = {t.name: t.nbytes for t in header.tensors}
    return (
        4 * sum(size for name, size in sizes.items() if name.startswith("blk.1."))
        + sizes["output.weight"]
        + 4096
    )


@contextlib.asynccontextmanager
async def placing(
    tmp_path: Path, node: Node, model: Path, on_drain: Callable[[AutoShard], None] = lambda _: None
) -> AsyncIterator[AutoShard]:
    holdings = Holdings()
    ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(node)
    settings = AutoPlaceConfig(
        store_dir=tmp_path / f"store-{node.node_id.hex()[:8]}",
        memory_budget=budget_for(model),
        poll_s=0.1,
        claim_settle_s=1.0,
        move_settle_s=0.5,
    )

    async def start_serving(request: ServeRequest) -> AnnouncedShard:
        return AnnouncedShard(node, request, lambda: on_drain(placement))

    placement = AutoShard(node, settings, start_serving, holdings)
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


async def test_two_nodes_placing_at_once_take_different_ranges_and_one_moves_when_the_other_leaves(tmp_path):
    model = ensure_tiny_model()
    root = build_manifest(model).root
    header = read_gguf(model)
    creator = await start_first_node(tmp_path)
    nodes: list[Node] = []
    try:
        announce(creator, root, CREATOR_LAYERS)
        creator_holdings = Holdings()
        creator_holdings.add(FullModel(model))
        ArtifactServer(creator_holdings, UploadLimiter(bytes_per_s=0)).register(creator)
        nodes = [await start_joiner(tmp_path, f"j{i}", creator) for i in range(2)]
        await eventually(lambda: all(len(node.peers()) == 2 for node in nodes), what="a full mesh")
        lower, higher = sorted(nodes, key=lambda node: node.node_id)
        verified_at_drain: list[set[str]] = []

        def note_verified(placement: AutoShard) -> None:
            held = placement._store.reopen(root)
            assert held is not None
            verified_at_drain.append(set(held.verified))
            held.close()

        async with (
            placing(tmp_path, lower, model) as first,
            placing(tmp_path, higher, model, note_verified) as second,
        ):
            await eventually(lambda: placed(first) and placed(second), timeout=30, what="both placed")
            # Both wanted the uncovered [2, 6); the lower id kept it. The other takes four layers
            # (its budget holds a vocabulary table or a fifth layer, not both) where replicas are
            # fewest; [0, 4) and [1, 5) tie, and ties go to the lowest start.
            assert placed(first) == (2, TINY_N_LAYERS)
            assert placed(second) == (0, 4)
            for placement in (first, second):
                layers = placed(placement)
                assert layers is not None
                wanted = tensors_for_range(header, *layers)
                held = placement._store.reopen(root)
                assert held is not None and wanted <= held.verified
                # Nothing outside the range came over: the tail's tables only to the tail.
                assert held.verified == wanted
                held.close()
            before = second.fetched_bytes

            await lower.shutdown()
            await eventually(lambda: placed(second) == (2, TINY_N_LAYERS), timeout=30, what="the move")
            # The new range's tensors were fetched while the old range still served: when it
            # began to drain, every one of them was already verified on disk.
            assert len(verified_at_drain) == 1
            assert tensors_for_range(header, 2, TINY_N_LAYERS) <= verified_at_drain[0]
            lacking = tensors_for_range(header, 2, TINY_N_LAYERS) - tensors_for_range(header, 0, 4)
            lacking_bytes = sum(t.nbytes for t in header.tensors if t.name in lacking)
            assert lacking_bytes <= second.fetched_bytes - before <= lacking_bytes + 64 * 1024
    finally:
        for node in (*nodes, creator):
            await node.shutdown()


def test_the_room_check_names_what_is_needed_and_where():
    from meshnode.artifacts.disk_room import NoDiskRoom, check_disk_room

    check_disk_room(Path("/"), 1, what="layers [0, 2)", reserve=0)
    with pytest.raises(NoDiskRoom, match=r"layers \[0, 2\) need .* MiB more under /, which has .* MiB free"):
        check_disk_room(Path("/"), 2**62, what="layers [0, 2)")


async def test_a_disk_without_room_or_failing_mid_fetch_is_retried_and_said_not_a_silent_stop(
    tmp_path, monkeypatch
):
    """A full model store used to end placement without a word: the node had joined, served
    nothing and logged nothing. Now the room is checked before the fetch, a write that fails
    mid-fetch is retried like a lost source, and both are in the placement status."""
    import shutil

    from meshnode.artifacts import disk_room
    from meshnode.artifacts.store import TensorWriter

    model = ensure_tiny_model()
    root = build_manifest(model).root
    creator = await start_first_node(tmp_path)
    joiner: Node | None = None
    real_disk_usage, real_write = shutil.disk_usage, TensorWriter.write
    try:
        announce(creator, root, CREATOR_LAYERS)
        holdings = Holdings()
        holdings.add(FullModel(model))
        ArtifactServer(holdings, UploadLimiter(bytes_per_s=0)).register(creator)
        joiner = await start_joiner(tmp_path, "j", creator)
        await eventually(lambda: joiner.peers(), what="the joiner sees the creator")

        monkeypatch.setattr(
            disk_room.shutil, "disk_usage", lambda path: real_disk_usage(path)._replace(free=2**20)
        )
        async with placing(tmp_path, joiner, model) as placement:
            await eventually(
                lambda: "more under" in placement.status()["state"], timeout=30, what="the room refusal"
            )
            assert placement.status()["state"].startswith("retrying: layers [2, 6) need ")
            assert placement.fetched_bytes == 0

            def no_space(self: TensorWriter, data: bytes) -> None:
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(disk_room.shutil, "disk_usage", real_disk_usage)
            monkeypatch.setattr(TensorWriter, "write", no_space)
            await eventually(
                lambda: "No space left on device" in placement.status()["state"],
                timeout=30,
                what="the failed write reported",
            )
            monkeypatch.setattr(TensorWriter, "write", real_write)
            await eventually(
                lambda: placed(placement) == (2, TINY_N_LAYERS), timeout=60, what="placed once room is back"
            )
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await creator.shutdown()
