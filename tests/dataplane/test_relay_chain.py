"""The same data plane over relay channels: three nodes that cannot dial each other, one relay.

Each node is a real ``Node`` (relay-only, as behind NAT) serving its shard through
``ShardService``; the client's session and the head's forward to the tail both
travel as sealed relay channels, served by the same dispatcher as QUIC streams.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engines.fake import FakeEngine
from meshnode.dataplane.route import make_hop
from meshnode.dataplane.service import ShardService, ShardServiceOptions
from meshnode.dataplane.session_link import ShardSession
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey, create_invite, issue_certificate
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node import Node, NodeConfig
from relay.server import RelayServer

from .harness import srange
from .recording_engine import LAYERS, SPEC
from .test_client import reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = [5, 3, 8, 1, 9, 2, 7]


def relayed(relay: Endpoint) -> NodeConfig:
    return NodeConfig(
        listen="127.0.0.1:0",
        heartbeat_interval=0.3,
        gossip_timeout=2.0,
        probe_timeout=2.0,
        connect_timeout=3.0,
        stream_type_timeout=2.0,
        directly_reachable=False,
        relay_only=True,
        relays=[relay],
    )


async def serve(node: Node, layers: tuple[int, int]) -> ShardService:
    options = ShardServiceOptions(model=Path("fake.gguf"), layers=layers, ctx=64)
    return await ShardService.start(
        node, options, refresh_interval_s=0.3, engine_factory=lambda: FakeEngine(SPEC)
    )


async def test_a_split_chain_runs_over_relay_channels(tmp_path: Path) -> None:
    mesh_key = MeshKey.generate()
    relay_server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id})
    await relay_server.start("127.0.0.1", 0)
    relay = Endpoint(relay_server.relay_id, f"127.0.0.1:{relay_server.address[1]}")
    first = NodeIdentity.generate()
    certificate = issue_certificate(
        mesh_key, node_id=first.node_id, issuer_id=first.node_id, unix_now=time.time()
    )
    head = Node(
        first,
        DataDir(tmp_path / "head"),
        relayed(relay),
        membership=MembershipState(mesh_key=mesh_key, certificate=certificate),
    )
    nodes = [head]
    services: list[ShardService] = []
    try:
        services.append(await serve(head, (0, 2)))
        await head.start()

        async def joiner(name: str) -> Node:
            invite = create_invite(
                mesh_key,
                issuer_id=head.node_id,
                bootstrap=[Endpoint(head.node_id, head.addresses[0])],
                relays=[relay],
                unix_now=time.time(),
            )
            node = Node(NodeIdentity.generate(), DataDir(tmp_path / name), relayed(relay), invite=invite)
            nodes.append(node)
            return node

        tail = await joiner("tail")
        services.append(await serve(tail, (2, LAYERS)))
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
        async with asyncio.timeout(10):  # the release passed along the chain
            while services[1].server.load().active_sessions:
                await asyncio.sleep(0.02)
    finally:
        for service in services:
            await service.aclose()
        await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)
        await relay_server.close()
