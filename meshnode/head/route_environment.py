"""What the generation driver needs from the mesh: candidates, links and liveness (:class:`RouteEnvironment`)."""

from __future__ import annotations

from typing import Protocol

from meshnode.head.planner import ShardCandidate
from meshnode.transport.base import PeerLink


class RouteEnvironment(Protocol):
    """What the driver needs from the mesh (a :class:`~meshnode.node.Node`, or a single local shard)."""

    def candidates(self) -> list[ShardCandidate]:
        """Every shard gossip currently offers, this node's own included."""
        ...

    async def link(self, node_id: bytes) -> PeerLink:
        """A link to the hop (an in-process one for this node itself)."""
        ...

    async def alive(self, node_id: bytes, probe_timeout: float) -> bool:
        """Whether the peer answers a liveness probe waiting ``probe_timeout`` at most.

        A mesh node may probe twice (once more around a relay that stopped answering).
        """
        ...


__all__ = ["RouteEnvironment"]
