"""In-process mesh for the data-plane edge: nodes with a real dispatcher, joined by loopback links.

Each :class:`MeshPeer` has an id, a :class:`~meshnode.mesh.dispatcher.Dispatcher`
that admits every peer, and ``get_link(peer_id)`` that makes (once) a loopback
link pair to another peer of the same :class:`LoopbackMesh` — the same calls a
``ShardServer`` and a ``ShardSession`` make on a real ``Node``. An :class:`AnnouncingPeer`
adds ``Node``'s announcement setters, recording what a ``ShardService`` announces.
"""

from __future__ import annotations

import asyncio

from meshnode.identity import NodeIdentity
from meshnode.mesh.dispatcher import Dispatcher, StreamHandler
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.loopback import LoopbackLink, loopback_link_pair
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh as mesh_pb


class MeshPeer:
    def __init__(self, mesh: LoopbackMesh, node_id: bytes) -> None:
        self.mesh = mesh
        self.node_id = node_id
        self.dispatcher = Dispatcher(is_admitted=lambda _peer: True, stream_type_timeout=2.0)
        self.links: dict[bytes, LoopbackLink] = {}
        self.streams_accepted = 0

    def register_handler(self, stream_type: StreamType, handler: StreamHandler) -> None:
        self.dispatcher.register(stream_type, handler)

    async def get_link(self, peer_id: bytes) -> PeerLink:
        link = self.links.get(peer_id)
        if link is None or link.is_closed:
            if peer_id not in self.mesh.peers or self.mesh.peers[peer_id].down:
                raise ConnectionError(f"peer {peer_id[:4].hex()} is unreachable")
            link, _ = self.mesh.connect(self, self.mesh.peers[peer_id])
        return link

    # LinkHandler
    def link_established(self, link: PeerLink) -> None:
        assert isinstance(link, LoopbackLink)  # the loopback mesh makes no other kind
        self.links[link.peer_id] = link

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.streams_accepted += 1
        self.dispatcher.accept(stream)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        if self.links.get(link.peer_id) is link:
            del self.links[link.peer_id]

    @property
    def down(self) -> bool:
        return self.mesh.down.get(self.node_id, False)

    def kill(self) -> None:
        """Like a SIGKILL: every link closes, nothing more is accepted."""
        self.mesh.down[self.node_id] = True
        for link in list(self.links.values()):
            link.close("peer killed")

    async def aclose(self) -> None:
        await self.dispatcher.aclose()


class LoopbackMesh:
    def __init__(self, *, stream_window: int = 1024 * 1024, connection_window: int = 4 * 1024 * 1024) -> None:
        self.peers: dict[bytes, MeshPeer] = {}
        self.down: dict[bytes, bool] = {}
        self.stream_window = stream_window
        self.connection_window = connection_window

    def add(self, index: int, node_id: bytes | None = None) -> MeshPeer:
        """Peer ``index``; its id is ``index`` repeated unless given (a node key's, to sign as it)."""
        peer = MeshPeer(self, node_id or bytes([index]) * 32)
        self.peers[peer.node_id] = peer
        return peer

    def connect(self, a: MeshPeer, b: MeshPeer) -> tuple[LoopbackLink, LoopbackLink]:
        return loopback_link_pair(
            a.node_id,
            b.node_id,
            a,
            b,
            stream_window=self.stream_window,
            connection_window=self.connection_window,
        )

    async def aclose(self) -> None:
        for peer in self.peers.values():
            for link in list(peer.links.values()):
                link.close("mesh closed")
        await asyncio.gather(*(p.aclose() for p in self.peers.values()))


class AnnouncingPeer:
    """A loopback mesh peer with the announcement setters of ``meshnode.node.Node``."""

    def __init__(self, loopback: LoopbackMesh, index: int) -> None:
        # A node key of its own, as a Node has (its shard signs its units' commitments with it).
        self.identity = NodeIdentity.from_seed(bytes([index]) * 32)
        self.peer = loopback.add(index, self.identity.node_id)
        self.node_id = self.peer.node_id
        self.serving: mesh_pb.ServedShard | None = None
        self.capacity: mesh_pb.Capacity | None = None
        self.loads: list[mesh_pb.Load] = []
        self.registered: list[StreamType] = []

    def register_handler(self, stream_type: StreamType, handler: StreamHandler) -> None:
        self.registered.append(stream_type)
        self.peer.register_handler(stream_type, handler)

    async def get_link(self, peer_id: bytes) -> PeerLink:
        return await self.peer.get_link(peer_id)

    def set_serving(self, serving: mesh_pb.ServedShard | None) -> None:
        self.serving = serving

    def set_capacity(self, capacity: mesh_pb.Capacity) -> None:
        self.capacity = capacity

    def set_load(self, load: mesh_pb.Load) -> None:
        self.loads.append(load)


__all__ = ["AnnouncingPeer", "LoopbackMesh", "MeshPeer"]
