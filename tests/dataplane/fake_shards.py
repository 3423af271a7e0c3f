"""Real nodes serving fake-engine shards through ``ShardService``: one shard, or a chain over a relay."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_relay_server
from helpers.recording_engine import LAYERS, SPEC

from engines.fake import FakeEngine
from meshnode.app.shard_service import ShardService, ShardServiceConfig
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node

# Where the relayed chain splits the fake model: the head serves [0, SPLIT), the tail the rest.
SPLIT = 2


async def serve_fake_shard(node: Node, layers: tuple[int, int]) -> ShardService:
    options = ShardServiceConfig(model=Path("fake.gguf"), layers=layers, ctx=64)
    return await ShardService.start(
        node, options, refresh_interval_s=0.3, engine_factory=lambda: FakeEngine(SPEC)
    )


@dataclass
class RelayedChain:
    """Three relay-only nodes (as behind NAT) and one relay: the head and the tail serve the fake
    model's halves, the client serves nothing."""

    head: Node
    tail: Node
    client: Node
    services: list[ShardService]


@contextlib.asynccontextmanager
async def relayed_chain(tmp_path: Path) -> AsyncIterator[RelayedChain]:
    mesh_key = MeshKey.generate()
    relay_server, relay = await start_relay_server(mesh_key)
    head = first_member(tmp_path / "head", relay_only_config(relay), mesh_key)
    nodes = [head]
    services: list[ShardService] = []
    try:
        services.append(await serve_fake_shard(head, (0, SPLIT)))
        await head.start()

        async def joiner(name: str) -> Node:
            invite = invite_from(head, relays=[relay])
            node = Node(
                NodeIdentity.generate(), DataDir(tmp_path / name), relay_only_config(relay), invite=invite
            )
            nodes.append(node)
            return node

        tail = await joiner("tail")
        services.append(await serve_fake_shard(tail, (SPLIT, LAYERS)))
        await tail.start()
        await tail.join()
        client = await joiner("client")
        await client.start()
        await client.join()
        yield RelayedChain(head, tail, client, services)
    finally:
        for service in services:
            await service.aclose()
        await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)
        await relay_server.close()


__all__ = ["SPLIT", "RelayedChain", "relayed_chain", "serve_fake_shard"]
