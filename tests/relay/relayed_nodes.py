"""Two in-process nodes that reach each other only through one relay, and their relay clients."""

from __future__ import annotations

from pathlib import Path

from helpers.mesh_nodes import first_member, invite_from, relay_only_config, start_invited_node
from helpers.polling import eventually

from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.node import Node
from meshnode.relaylink.client import RelayClient


async def start_relayed_pair(
    tmp_path: Path, mesh_key: MeshKey, relay: Endpoint, nodes: list[Node]
) -> tuple[Node, Node]:
    """A, the mesh's first member, and B, joined with A's invite, both registered with ``relay``
    only and each in the other's table. Each is appended to ``nodes`` once started: the caller
    shuts them down."""
    node_a = first_member(tmp_path / "a", relay_only_config(relay), mesh_key)
    nodes.append(node_a)
    await node_a.start()
    await eventually(lambda: node_a.relay_links is not None and node_a.relay_links.registered_relays(), 20)
    node_b = await start_invited_node(
        tmp_path / "b", relay_only_config(relay), invite_from(node_a, relays=[relay])
    )
    nodes.append(node_b)
    await eventually(
        lambda: node_a.node_id in node_b.state.table and node_b.node_id in node_a.state.table, 20
    )
    return node_a, node_b


def client_of(node: Node) -> RelayClient:
    """The client of the one relay ``node`` uses."""
    assert node.relay_links is not None
    (endpoint,) = node.relay_links.relays
    client = node.relay_links.client(endpoint.id)
    assert client is not None
    return client
