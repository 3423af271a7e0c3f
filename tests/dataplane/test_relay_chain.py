"""The same data plane over relay channels: three nodes that cannot dial each other, one relay.

Each node is a real ``Node`` (relay-only, as behind NAT) serving its shard through
``ShardService``; the client's session and the head's forward to the tail both
travel as sealed relay channels, served by the same dispatcher as QUIC streams.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_relay_server
from helpers.polling import eventually
from helpers.recording_engine import LAYERS

from meshnode.dataplane.route import make_hop
from meshnode.dataplane.service import ShardService
from meshnode.dataplane.session_link import ShardSession
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node

from .fake_shards import serve_fake_shard
from .harness import reference, srange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = [5, 3, 8, 1, 9, 2, 7]


async def test_a_split_chain_runs_over_relay_channels(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    relay_server, relay = await start_relay_server(mesh_key)
    head = first_member(tmp_path / "head", relay_only_config(relay), mesh_key)
    nodes = [head]
    services: list[ShardService] = []
    try:
        services.append(await serve_fake_shard(head, (0, 2)))
        await head.start()

        async def joiner(name: str) -> Node:
            invite = invite_from(head, relays=[relay])
            node = Node(
                NodeIdentity.generate(), DataDir(tmp_path / name), relay_only_config(relay), invite=invite
            )
            nodes.append(node)
            return node

        tail = await joiner("tail")
        services.append(await serve_fake_shard(tail, (2, LAYERS)))
        await tail.start()
        await tail.join()
        client = await joiner("client")
        await client.start()
        await client.join()

        link = await client.get_link(head.node_id)
        assert link.description.startswith("relay ")
        fingerprint = services[0].served.fingerprint
        async with ShardSession.open(
            lambda: client.get_link(head.node_id),
            fingerprint=fingerprint,
            shard_range=srange(0, 2),
            downstream=[make_hop(tail.node_id, 2, LAYERS, 2)],
        ) as session:
            tokens = [(await session.prefill(PROMPT)).token]
            for position in range(len(PROMPT), len(PROMPT) + 5):
                tokens.append((await session.decode(tokens[-1], position=position)).token)
        assert tokens == reference(PROMPT, 5)
        # The head reached the tail through the relay too.
        head_to_tail = await head.get_link(tail.node_id)
        assert head_to_tail.description.startswith("relay ")
        # The release passed along the chain.
        await eventually(lambda: not services[1].server.load().active_sessions, 10)
    finally:
        for service in services:
            await service.aclose()
        await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)
        await relay_server.close()
