"""A real node serving a fake-engine shard through ``ShardService`` (relay-channel chain tests)."""

from __future__ import annotations

from pathlib import Path

from helpers.recording_engine import SPEC

from engines.fake import FakeEngine
from meshnode.dataplane.service import ShardService, ShardServiceOptions
from meshnode.node import Node


async def serve_fake_shard(node: Node, layers: tuple[int, int]) -> ShardService:
    options = ShardServiceOptions(model=Path("fake.gguf"), layers=layers, ctx=64)
    return await ShardService.start(
        node, options, refresh_interval_s=0.3, engine_factory=lambda: FakeEngine(SPEC)
    )
