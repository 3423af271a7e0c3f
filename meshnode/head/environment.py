"""Where the driver's routes come from: a mesh node's gossip, or one whole-model shard on its own.

:class:`NodeRoutes` reads the node's peer table (plus what this node itself
serves), less the nodes that audit evidence the node holds convicts (its own head's
convictions, and every one gossip brought, each verified: :mod:`meshnode.node.evidence_keeper`)
unless an admin's mesh policy cleared them, and, where the policy requires handoffs, the hops
that do not announce they sign them,
links to peers with ``Node.get_link`` and checks liveness with the mesh
PROBE, which the peer's event loop answers at once (a shard's Health waits for
its engine thread, so a busy peer would look dead); ``Node.reachable`` probes once
more around a relay that stopped answering. This node's own shard is
reached through a :class:`~meshnode.head.local_link.LocalShardLink`.

:class:`StandaloneShardHost` is the whole-model single-node mode: it is both
what the shard service needs from a node (handlers, announcements) and the
route environment, with one candidate — itself — and no network at all.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from meshnode.head.candidates import CandidateIndex, shard_candidates, stating_handoffs
from meshnode.head.local_link import LocalShardLink
from meshnode.head.planner import ShardCandidate
from meshnode.identity import NodeIdentity
from meshnode.mesh.dispatcher import StreamHandler
from meshnode.transport.base import PeerLink
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh

if TYPE_CHECKING:
    from meshnode.node import Node


class NodeRoutes:
    def __init__(self, node: Node, local: LocalShardLink | None = None) -> None:
        self.node = node
        self.local = local
        self._index = CandidateIndex()

    def candidates(self) -> list[ShardCandidate]:
        candidates = self._index.candidates(self.node.peers())
        if self.local is not None:
            # Our own announcement changes in place: read it each time (one candidate).
            candidates.extend(shard_candidates([(self.node.node_id, self.node.state.local)]))
        excluded = self.node.evidence.excluded()
        candidates = [candidate for candidate in candidates if candidate.node_id not in excluded]
        return stating_handoffs(candidates) if self.node.evidence.requires_handoffs() else candidates

    async def link(self, node_id: bytes) -> PeerLink:
        if node_id == self.node.node_id:
            if self.local is None:
                raise ConnectionError("this node serves no shard")
            return await self.local.link()
        return await self.node.get_link(node_id)

    async def alive(self, node_id: bytes, probe_timeout: float) -> bool:
        if node_id == self.node.node_id:
            return self.local is not None
        return await self.node.reachable(node_id, probe_timeout)


class StandaloneShardHost:
    """A node of one: serves its shard to itself. Satisfies the shard service's ``ServingNode``
    and the driver's ``RouteEnvironment``."""

    def __init__(self, node_id: bytes | None = None) -> None:
        self.node_id = node_id or os.urandom(32)
        self.local = LocalShardLink(self.node_id)
        self.announcement = mesh.PeerAnnouncement(endpoint_id=self.node_id)
        # A node of one has no replica to audit against: its units are not signed.
        self.identity: NodeIdentity | None = None

    # ServingNode
    def register_handler(self, stream_type: StreamType, handler: StreamHandler) -> None:
        self.local.register(stream_type, handler)

    async def get_link(self, peer_id: bytes) -> PeerLink:
        if peer_id != self.node_id:
            raise ConnectionError("a standalone node has no peers")
        return await self.local.link()

    def set_serving(self, serving: mesh.ServedShard | None) -> None:
        if serving is None:
            self.announcement.ClearField("serving")
        else:
            self.announcement.serving.CopyFrom(serving)

    def set_capacity(self, capacity: mesh.Capacity) -> None:
        self.announcement.capacity.CopyFrom(capacity)

    def set_load(self, load: mesh.Load) -> None:
        self.announcement.load.CopyFrom(load)

    # RouteEnvironment
    def candidates(self) -> list[ShardCandidate]:
        return shard_candidates([(self.node_id, self.announcement)])

    async def link(self, node_id: bytes) -> PeerLink:
        return await self.get_link(node_id)

    async def alive(self, node_id: bytes, probe_timeout: float) -> bool:
        return node_id == self.node_id

    async def aclose(self) -> None:
        await self.local.aclose()


__all__ = ["NodeRoutes", "StandaloneShardHost"]
