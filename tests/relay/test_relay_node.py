"""Nodes that cannot dial each other join and talk through a relay (in-process, loopback).

``relay_only`` stands in for NAT here; ``tests/nat`` runs the same with real
masquerading routers in network namespaces.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers.mesh_nodes import (
    first_member,
    invite_from,
    new_membership,
    relay_only_config,
    start_relay_server,
)
from helpers.polling import eventually

from meshnode.app.status import format_status
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node import Node, NodeConfig
from meshnode.node.status_report import AnnouncedRelay, RelayStatus
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh

pytestmark = pytest.mark.timeout(60)


async def test_invited_node_joins_through_the_relay_and_members_reach_it_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relay")
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    node_a = first_member(tmp_path / "a", relay_only_config(relay), mesh_key)
    node_b: Node | None = None
    node_c: Node | None = None
    try:
        await node_a.start()
        # The first member keeps the relay in its membership, so its invites carry it.
        assert [r.id for r in node_a.state.membership.relays] == [server.relay_id]
        invite = invite_from(node_a, relays=node_a.state.membership.relays)
        node_b = Node(NodeIdentity.generate(), DataDir(tmp_path / "b"), relay_only_config(), invite=invite)
        await node_b.start()
        await (
            node_b.join()
        )  # registers with the invite's relay using the invite proof, then gossips through it
        assert node_b.state.is_member

        def see_each_other() -> bool:
            return node_b.node_id in node_a.state.table and node_a.node_id in node_b.state.table

        await eventually(see_each_other)
        status_a, status_b = node_a.status(), node_b.status()
        (peer_b,) = status_a.peers
        assert peer_b.id == node_b.node_id.hex()
        assert peer_b.directly_reachable is False
        assert peer_b.relays == [AnnouncedRelay(id=server.relay_id.hex(), address=relay.address)]
        assert peer_b.link is not None and peer_b.link.startswith("relay ")
        assert status_b.node.relays == [
            RelayStatus(id=server.relay_id.hex(), address=relay.address, registered=True)
        ]

        # get_link goes through the relay and every mesh handler runs unchanged over it.
        assert await node_a.probe(node_b.node_id)
        assert await node_b.probe(node_a.node_id)
        link = await node_a.get_link(node_b.node_id)
        assert link.description.startswith("relay ")
        stream = await link.open_stream(StreamType.ROUTE_REQUEST)
        await stream.send_frame(
            mesh.RouteTableRequest(requester_id=node_a.node_id, gen=1).SerializeToString()
        )
        stream.finish()
        table = mesh.RouteTable.FromString(await stream.recv_frame(3))
        assert table.mesh_id == mesh_key.mesh_id
        assert node_a.relay_links.frames_dropped == node_b.relay_links.frames_dropped == 0

        # A public node configured with no relay at all reaches NATed B through the relay B announces.
        plain_invite = invite_from(node_a)
        node_c = Node(
            NodeIdentity.generate(),
            DataDir(tmp_path / "c"),
            relay_only_config(directly_reachable=True, relay_only=False),
            invite=plain_invite,
        )
        await node_c.start()
        await node_c.join()  # directly, through A's QUIC address
        assert node_c.status().node.relays == []
        await eventually(lambda: node_b.node_id in node_c.state.table)
        assert await node_c.probe(node_b.node_id)
        assert (await node_c.get_link(node_b.node_id)).description.startswith("relay ")
        assert [r.id for r in node_c.status().node.relays] == [server.relay_id.hex()]
        # The relay's log names each registration and how it ended.
        relay_lines = [r.getMessage() for r in caplog.records if r.name == "relay.server"]
        assert any(
            line.startswith(f"registered node {node_b.identity.short_id} at 127.0.0.1:")
            for line in relay_lines
        )
    finally:
        if node_c is not None:
            await node_c.shutdown()
        if node_b is not None:
            await node_b.shutdown()
        await node_a.shutdown()
        await server.close(flush_timeout=0.3)


async def test_a_wrong_relay_id_is_named_with_its_fix_in_the_log_and_in_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    mistyped = Endpoint(NodeIdentity.generate().node_id, relay.address)
    node = first_member(tmp_path / "a", relay_only_config(mistyped), mesh_key)
    caplog.set_level(logging.DEBUG)
    try:
        await node.start()
        (status,) = await eventually(lambda: [r for r in node.status().node.relays if r.problem], 10)
        hint = (
            "the relay id given (--relay, or in the invite) is not this relay's; `meshnode relay --show-id`"
        )
        assert status.registered is False
        assert status.problem.startswith(f"peer key {short_id(server.relay_id)} is not the expected node")
        assert hint in status.problem
        shown = format_status(node.status().to_json())
        assert f"  relay {short_id(mistyped.id)}@{relay.address}: not registered (peer key" in shown
        assert [r.levelname for r in caplog.records if hint in r.getMessage()] == ["WARNING"]
        # The dial's own refusal is the relay client's to report: no INFO line per retry besides.
        refusals = [r for r in caplog.records if r.getMessage().startswith("refused QUIC connection")]
        assert refusals and {r.levelname for r in refusals} == {"DEBUG"}
    finally:
        await node.shutdown()
        await server.close(flush_timeout=0.3)


async def test_a_relay_serving_other_meshes_is_named_with_the_option_it_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mesh_key, other_mesh = MeshKey.generate(), MeshKey.generate()
    server, relay = await start_relay_server(other_mesh)
    node = first_member(tmp_path / "a", relay_only_config(relay), mesh_key)
    caplog.set_level(logging.DEBUG, logger="relay")
    try:
        await node.start()
        (status,) = await eventually(lambda: [r for r in node.status().node.relays if r.problem], 10)
        assert status.problem == (
            "RELAY_ERROR_NOT_A_MEMBER: this relay does not serve that mesh: "
            f"start the relay with --mesh {mesh_key.mesh_id} (repeatable, one per mesh it serves)"
        )

        # The relay's operator reads it too, once however often the node retries. (Each refusal is
        # logged as its frame goes out, after the relay's count has grown: wait for the lines.)
        def refused_lines() -> list[logging.LogRecord]:
            return [
                r for r in caplog.records if r.name == "relay.server" and "refused node" in r.getMessage()
            ]

        await eventually(lambda: len(refused_lines()) >= 3, 10)
        refused = refused_lines()
        assert server.core.stats.refused_registrations >= 3
        assert [r.levelname for r in refused][:3] == ["INFO", "DEBUG", "DEBUG"]
        assert refused[0].getMessage().startswith(f"refused node {short_id(node.node_id)} at 127.0.0.1:")
        assert (
            refused[0]
            .getMessage()
            .endswith(": RELAY_ERROR_NOT_A_MEMBER: this relay does not serve that mesh")
        )
    finally:
        await node.shutdown()
        await server.close(flush_timeout=0.3)


async def test_a_relay_that_moved_is_followed_and_one_taken_out_of_service_is_forgotten(
    tmp_path: Path,
) -> None:
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    data_dir = DataDir(tmp_path / "a")
    identity = NodeIdentity.generate()

    async def run_once(
        config: NodeConfig, membership: MembershipState, *, registers: bool = False
    ) -> list[RelayStatus]:
        node = Node(identity, data_dir, config, membership=membership)
        try:
            await node.start()
            if registers:
                await eventually(lambda: all(r.registered for r in node.status().node.relays), 10)
            return node.status().node.relays
        finally:
            await node.shutdown()

    try:
        # Stored at an address where the relay no longer is (it moved).
        old = Endpoint(relay.id, "127.0.0.1:9")
        await run_once(relay_only_config(old), new_membership(mesh_key, identity))
        assert data_dir.load_membership(identity.node_id).relays == [old]

        statuses = await run_once(
            relay_only_config(relay), data_dir.load_membership(identity.node_id), registers=True
        )
        assert statuses == [RelayStatus(id=relay.id.hex(), address=relay.address, registered=True)]
        assert data_dir.load_membership(identity.node_id).relays == [relay]

        forgetting = relay_only_config(forget_relays=[relay.id])
        assert await run_once(forgetting, data_dir.load_membership(identity.node_id)) == []
        assert data_dir.load_membership(identity.node_id).relays == []
    finally:
        await server.close(flush_timeout=0.3)


async def test_relay_only_without_any_relay_says_the_node_dials_no_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = first_member(tmp_path / "a", relay_only_config(), MeshKey.generate())
    try:
        await node.start()
    finally:
        await node.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("--relay-only with no relay: this node dials no peer") for w in warnings), (
        warnings
    )


async def test_a_joiner_keeps_its_own_relays_besides_the_invites(tmp_path: Path) -> None:
    # Its membership used to keep the invite's relays only: a restart without --relay lost
    # the relay the node had been told to use.
    mesh_key = MeshKey.generate()
    (server_1, relay_1), (server_2, relay_2) = [await start_relay_server(mesh_key) for _ in range(2)]
    node_a = first_member(tmp_path / "a", relay_only_config(relay_1), mesh_key)
    node_b: Node | None = None
    try:
        await node_a.start()
        assert node_a.relay_links is not None
        await node_a.relay_links.wait_registered(10)  # the joiner reaches A through relay_1 only
        invite = invite_from(node_a, relays=[relay_1])
        node_b = Node(
            NodeIdentity.generate(), DataDir(tmp_path / "b"), relay_only_config(relay_2), invite=invite
        )
        await node_b.start()
        await node_b.join()
        stored = DataDir(tmp_path / "b").load_membership(node_b.node_id)
        assert stored.relays == [relay_1, relay_2]
    finally:
        if node_b is not None:
            await node_b.shutdown()
        await node_a.shutdown()
        await server_1.close(flush_timeout=0.3)
        await server_2.close(flush_timeout=0.3)
