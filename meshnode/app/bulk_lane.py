"""A node's bulk lane, composed: its artifacts served over TLS on TCP at its own port number,
and the lanes its fetches use (:mod:`meshnode.artifacts.bulk_lanes`).

Built before the node starts (the fetches' lanes need only its identity and peer table);
:meth:`NodeBulkLane.start` listens once the node's QUIC socket is bound, on the same host
and port number. A port taken on TCP leaves the node serving artifacts over QUIC only.
"""

from __future__ import annotations

from meshnode.artifacts.bulk_lanes import BulkLanes, lane_address
from meshnode.artifacts.bulk_server import BulkLaneServer
from meshnode.artifacts.server import ArtifactServer
from meshnode.node import Node
from meshnode.transport.base import PeerLink
from meshnode.transport.tls_lane import LaneContexts


class NodeBulkLane:
    def __init__(self, node: Node, artifacts: ArtifactServer) -> None:
        self._node = node
        self.contexts = LaneContexts(node.identity)
        self.server = BulkLaneServer(
            artifacts,
            self.contexts,
            is_admitted=node.state.is_admitted,
            check_peer=node.state.revocations.check_node,
            admitted=node.state.admitted,
        )
        self.lanes = BulkLanes(node.get_link, self.contexts, self._address_of)
        self.listening = False

    async def start(self, node: Node) -> None:
        """Listen on TCP at the node's QUIC host and port number (call once it started)."""
        assert node.endpoint is not None, "the node has not started"
        host, port = node.endpoint.local_address
        self.listening = await self.server.listen(host, port)

    async def close(self) -> None:
        self.lanes.close()
        await self.server.close()

    def _address_of(self, link: PeerLink) -> tuple[str, int] | None:
        return lane_address(link, self._node.state.table.announcement_of(link.peer_id))


__all__ = ["NodeBulkLane"]
