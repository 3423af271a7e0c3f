"""Nodes serving the tiny model's artifacts over the bulk lane, and what the lane tests share."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from meshnode.app.bulk_lane import NodeBulkLane
from meshnode.artifacts.bulk_lanes import BulkLanes
from meshnode.artifacts.holdings import HeldArtifact, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.node import Node

from .transfer_nodes import Peer, serve


@dataclass
class LanePeer:
    peer: Peer
    lane: NodeBulkLane

    @property
    def id(self) -> bytes:
        return self.peer.id

    @property
    def server(self) -> ArtifactServer:
        return self.peer.server


async def serve_on_lane(node: Node, artifact: HeldArtifact, **options) -> LanePeer:
    peer = serve(node, artifact, **options)
    lane = NodeBulkLane(node, peer.server)
    await lane.start(node)
    assert lane.listening
    return LanePeer(peer, lane)


def lanes_of(node: Node) -> BulkLanes:
    """What a joiner fetches through (it serves nothing itself)."""
    return NodeBulkLane(node, ArtifactServer(Holdings())).lanes


def free_on_tcp_too() -> str:
    """A loopback address whose port number is free on UDP and on TCP, for a node and its lane
    (a port free on UDP may be taken on TCP, by another test's outgoing connection say)."""
    while True:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return f"127.0.0.1:{port}"


def quic_port(node: Node) -> int:
    assert node.endpoint is not None
    return node.endpoint.local_address[1]
