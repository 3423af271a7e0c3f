"""A two-shard llama.cpp chain to drive like the head will, over real QUIC or the in-process loopback.

Over QUIC the shards are ``meshnode`` processes of a ``helpers.node_processes.QuicCluster``
on the tiny model, ``[0, 3)`` and ``[3, 6)``, and the test process joins the same mesh as
a client node (``quic_chain``). ``LoopbackChain``: the same two shards as in-process
``ShardServer``s joined by loopback links. Both give the same ``ChainUnderTest`` so one
test body runs over either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from helpers.loopback_mesh import LoopbackMesh, MeshPeer
from helpers.mesh_nodes import serving_peer
from helpers.tiny_llama import SPLIT

from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS
from meshnode.dataplane.edges.server import ShardServer
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.route import make_hop
from meshnode.node import Node
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import shard

from .harness import srange


@dataclass
class ChainUnderTest:
    """What a test needs: where the head shard is, the tail's id, the served fingerprint."""

    transport: str
    links: Callable[[], Awaitable[PeerLink]]
    head_id: bytes
    tail_id: bytes
    fingerprint: shard.Fingerprint
    # The client's mesh node (QUIC only): what the shards announce is in its peer table.
    node: Node | None = None

    def open(self, **kwargs: Any) -> object:
        kwargs.setdefault("fingerprint", self.fingerprint)
        kwargs.setdefault("shard_range", srange(0, SPLIT))
        kwargs.setdefault("downstream", [make_hop(self.tail_id, SPLIT, TINY_N_LAYERS, SPLIT)])
        return ShardSession.open(self.links, **kwargs)


# ---------------------------------------------------------------------------- in-process loopback


class LoopbackChain:
    def __init__(self, head_engine: LlamaShardEngine, tail_engine: LlamaShardEngine) -> None:
        self.head_engine = head_engine
        self.tail_engine = tail_engine
        self.mesh = LoopbackMesh()
        self.client, self.head, self.tail = self.mesh.add(1), self.mesh.add(2), self.mesh.add(3)
        self.servers: list[ShardServer] = []

    async def start(self) -> ChainUnderTest:
        for engine, peer in ((self.head_engine, self.head), (self.tail_engine, self.tail)):
            server = ShardServer(engine, links=peer.get_link)
            assert (await server.start()).validated
            server.register(peer.register_handler)
            self.servers.append(server)
        fp = self.servers[0].worker.fingerprint
        client: MeshPeer = self.client
        head_id = self.head.node_id
        return ChainUnderTest("loopback", lambda: client.get_link(head_id), head_id, self.tail.node_id, fp)

    async def aclose(self) -> None:
        for server in self.servers:
            await server.aclose()
        await self.mesh.aclose()


# ---------------------------------------------------------------------------- two meshnode processes


async def quic_chain(node: Node) -> ChainUnderTest:
    """The cluster's two shards as ``node``, a client node in their mesh, finds them announced."""
    head_id, fingerprint = await serving_peer(node, 0, SPLIT)
    tail_id, tail_fingerprint = await serving_peer(node, SPLIT, TINY_N_LAYERS)
    assert tail_fingerprint == fingerprint

    async def link() -> PeerLink:
        return await node.get_link(head_id)

    return ChainUnderTest("quic", link, head_id, tail_id, fingerprint, node)


__all__ = ["ChainUnderTest", "LoopbackChain", "quic_chain"]
