"""In-process mesh nodes for tests: configs, memberships, invites, starting and joining.

``start_first_node`` creates a mesh (or ``mesh_key``'s) as its first member;
``start_joiner`` joins another node's mesh with an invite it issued; ``start_invited_node``
joins with any invite (one a ``meshnode`` process issued, say). ``serving_peer`` waits
until a node's peer table shows who serves a layer range.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers.polling import eventually
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, Invite, MeshKey, create_invite, issue_certificate
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node import Node, NodeConfig
from meshnode.wire.pb import shard
from relay.server import RelayServer


def fast_config(**overrides: Any) -> NodeConfig:
    """A node on loopback that notices a silent peer within seconds."""
    settings: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "heartbeat_interval": 0.2,
        # Short, but not so short that a loaded 2-core CI machine sees false failures.
        "gossip_timeout": 2.0,
        "probe_timeout": 2.0,
        "connect_timeout": 2.0,
        "stream_type_timeout": 1.0,
        "tombstone_ttl": 30.0,
    }
    settings.update(overrides)
    return NodeConfig(**settings)


def cluster_client_config() -> NodeConfig:
    """A client node in the same mesh as ``meshnode`` processes (it serves nothing, it asks)."""
    return NodeConfig(
        listen="127.0.0.1:0",
        heartbeat_interval=0.3,
        gossip_timeout=2.0,
        probe_timeout=2.0,
        connect_timeout=2.0,
        stream_type_timeout=2.0,
    )


def relay_only_config(relay: Endpoint | None = None, **overrides: Any) -> NodeConfig:
    """A node that cannot be dialed and dials no one (NAT, in one process): only through ``relay``."""
    settings: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "heartbeat_interval": 0.3,
        "gossip_timeout": 2.0,
        "probe_timeout": 2.0,
        "connect_timeout": 3.0,
        "stream_type_timeout": 2.0,
        "directly_reachable": False,
        "relay_only": True,
        "relays": [relay] if relay is not None else [],
    }
    settings.update(overrides)
    return NodeConfig(**settings)


def new_membership(mesh_key: MeshKey, identity: NodeIdentity) -> MembershipState:
    """``identity`` as a member of ``mesh_key``'s mesh, holding the mesh key (as its creator does)."""
    certificate = issue_certificate(
        mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, unix_now=time.time()
    )
    return MembershipState(mesh_key=mesh_key, certificate=certificate)


def invite_to(mesh_key: MeshKey, issuer_id: bytes, address: str, relays: Sequence[Endpoint] = ()) -> Invite:
    """An invite into ``mesh_key``'s mesh from ``issuer_id``, who listens at ``address``."""
    return create_invite(
        mesh_key,
        issuer_id=issuer_id,
        bootstrap=[Endpoint(issuer_id, address)],
        relays=list(relays),
        unix_now=time.time(),
    )


def invite_from(node: Node, relays: Sequence[Endpoint] = ()) -> Invite:
    """An invite that ``node``, a member holding the mesh key, issues: it is the bootstrap peer."""
    membership = node.state.membership
    assert membership is not None, "only a member can invite"
    return invite_to(membership.mesh_key, node.node_id, node.addresses[0], relays)


def first_member(data_dir: Path, config: NodeConfig, mesh_key: MeshKey) -> Node:
    """A node that is a member of ``mesh_key``'s mesh from the start (it holds the key); not started."""
    identity = NodeIdentity.generate()
    return Node(identity, DataDir(data_dir), config, membership=new_membership(mesh_key, identity))


async def start_first_node(
    tmp_path: Path, name: str = "first", mesh_key: MeshKey | None = None, **config: object
) -> Node:
    node = first_member(tmp_path / name, fast_config(**config), mesh_key or MeshKey.generate())
    await node.start()
    return node


async def start_invited_node(data_dir: Path, config: NodeConfig, invite: Invite) -> Node:
    """A new node that has started and joined with ``invite`` (shut down again if it cannot)."""
    node = Node(NodeIdentity.generate(), DataDir(data_dir), config, invite=invite)
    try:
        await node.start()
        await node.join()
    except BaseException:
        await node.shutdown()
        raise
    return node


async def start_joiner(tmp_path: Path, name: str, bootstrap: Node, **config: object) -> Node:
    return await start_invited_node(tmp_path / name, fast_config(**config), invite_from(bootstrap))


async def start_relay_server(mesh_key: MeshKey) -> tuple[RelayServer, Endpoint]:
    """An in-process relay serving ``mesh_key``'s mesh on a free loopback port, and where it listens."""
    server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id})
    await server.start("127.0.0.1", 0)
    return server, Endpoint(server.relay_id, f"127.0.0.1:{server.address[1]}")


def serving(node: Node, start_layer: int, end_layer: int) -> tuple[bytes, shard.Fingerprint] | None:
    """The id and fingerprint of a peer ``node`` knows to serve ``[start_layer, end_layer)``, if any."""
    for entry in node.peers():
        announcement = entry.announcement
        served = announcement.serving.shard_range
        if announcement.HasField("serving") and (served.start_layer, served.end_layer) == (
            start_layer,
            end_layer,
        ):
            return entry.peer_id, announcement.serving.fingerprint
    return None


async def serving_peer(
    node: Node, start_layer: int, end_layer: int, timeout: float = 20.0
) -> tuple[bytes, shard.Fingerprint]:
    """The id and fingerprint of the peer serving ``[start_layer, end_layer)``, once it is announced."""
    return await eventually(
        lambda: serving(node, start_layer, end_layer),
        timeout,
        f"a peer serving [{start_layer}, {end_layer})",
        interval=0.05,
    )


__all__ = [
    "cluster_client_config",
    "fast_config",
    "first_member",
    "invite_from",
    "invite_to",
    "new_membership",
    "relay_only_config",
    "serving",
    "serving_peer",
    "start_first_node",
    "start_invited_node",
    "start_joiner",
    "start_relay_server",
]
