"""How a node is set up (:class:`NodeConfig`) and how its join fails (:class:`JoinError`), apart
from the node itself so that the command line reads them without loading it."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode.membership.credentials import DEFAULT_CERTIFICATE_TTL_S, Endpoint
from meshnode.mesh.peer_table import DEFAULT_MAX_PEERS
from meshnode.transport.quic_config import QuicConfig
from meshnode.traversal.config import TraversalConfig
from meshnode.wire.pb import mesh

DEFAULT_PORT = 7447
DEFAULT_LISTEN = f"0.0.0.0:{DEFAULT_PORT}"


class JoinError(Exception):
    """No bootstrap peer admitted us; the message is the one-line reason. ``refused``: one of
    them answered no, which another try would only repeat; else none could be reached."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class NodeConfig:
    listen: str = DEFAULT_LISTEN
    # Addresses announced to peers; default: the bound address (see Node.addresses).
    advertise: list[str] = field(default_factory=list)
    heartbeat_interval: float = 5.0
    # Wait for a gossip reply / a probe echo.
    gossip_timeout: float = 3.0
    probe_timeout: float = 3.0
    # A peer with no fresher announcement for this long is probed; default 4 heartbeats.
    peer_timeout: float | None = None
    tombstone_ttl: float = 60.0
    connect_timeout: float = 5.0
    stream_type_timeout: float = 5.0
    leave_timeout: float = 1.0
    # Links to one peer that came up this close together are a simultaneous dial.
    link_race_window: float = 2.0
    directly_reachable: bool = True
    # Relays to register with besides those of the invite / stored membership (kept in membership;
    # a stored relay's address is replaced by the one given here), and relay ids to drop from it.
    relays: list[Endpoint] = field(default_factory=list)
    forget_relays: list[bytes] = field(default_factory=list)
    # Never dial peers directly; always go through a relay (tests, strict NAT).
    relay_only: bool = False
    role: mesh.NodeRole = mesh.NODE_ROLE_WORKER
    http_port: int = 0
    # Lifetime of the member certificates this node issues and renews, as an admin.
    certificate_ttl: float = DEFAULT_CERTIFICATE_TTL_S
    quic: QuicConfig = field(default_factory=QuicConfig)
    # Hole punching, the LAN shortcut and the watch over direct paths to peers behind NAT.
    traversal: TraversalConfig = field(default_factory=TraversalConfig)
    # Delta gossip (meshnode.mesh.digest_gossip): each heartbeat a digest exchange with
    # gossip_fanout peers of an active view of active_view, instead of the whole table with
    # every peer. Off by default while it is new.
    delta_gossip: bool = False
    gossip_fanout: int = 3
    active_view: int = 8
    # The most peers the table holds; a new member beyond it is refused MESH_ERROR_TABLE_FULL
    # (meshnode.mesh.peer_table.DEFAULT_MAX_PEERS says why the number).
    max_peers: int = DEFAULT_MAX_PEERS

    @property
    def effective_peer_timeout(self) -> float:
        return self.peer_timeout if self.peer_timeout is not None else 4 * self.heartbeat_interval


__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "JoinError", "NodeConfig"]
