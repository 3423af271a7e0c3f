"""IPv6 and dual-stack nodes, over real QUIC on loopback: a node listening on ``[::1]`` or
``[::]`` dials and is dialed (it used to time out every handshake it started, because the
address it dialed was not the one its socket reported the answers from), an IPv4-only node
says why it cannot dial an IPv6 peer, and a relay is reached at an IPv6 address."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers.mesh_helpers import Recorder
from helpers.mesh_nodes import fast_config, first_member, invite_from, relay_only_config
from helpers.polling import eventually

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.membership.store import DataDir
from meshnode.node import Node
from meshnode.transport.local_addresses import advertised_hosts, outbound_address
from meshnode.transport.quic import DialError, QuicEndpoint
from meshnode.transport.udp_address import (
    FamilyMismatch,
    describe_sockaddr,
    local_host_to_reach,
    sockaddr_for,
)
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")


def test_the_dialed_address_is_shaped_as_the_socket_reports_its_peers():
    assert sockaddr_for(socket.AF_INET, "127.0.0.1", 7) == ("127.0.0.1", 7)
    assert sockaddr_for(socket.AF_INET6, "127.0.0.1", 7) == ("::ffff:127.0.0.1", 7, 0, 0)
    assert sockaddr_for(socket.AF_INET6, "::1", 7) == ("::1", 7, 0, 0)
    assert sockaddr_for(socket.AF_INET6, "::ffff:10.0.0.1", 7) == ("::ffff:10.0.0.1", 7, 0, 0)
    with pytest.raises(FamilyMismatch, match=r"listen on \[::\]:PORT"):
        sockaddr_for(socket.AF_INET, "::1", 7)
    with pytest.raises(ValueError):
        sockaddr_for(socket.AF_INET, "relay.example.net", 7)
    assert describe_sockaddr(("::ffff:10.0.0.1", 7, 0, 0)) == "10.0.0.1:7"
    assert describe_sockaddr(("::1", 7, 0, 0)) == "[::1]:7"
    assert describe_sockaddr(("10.0.0.1", 7)) == "10.0.0.1:7"


def test_a_relay_dialer_binds_the_family_of_the_relays_address():
    assert local_host_to_reach("[2001:db8::1]:7448") == "::"
    assert local_host_to_reach("192.0.2.1:7448") == "0.0.0.0"
    assert local_host_to_reach("relay.example.net:7448") == "0.0.0.0"
    assert local_host_to_reach("[2001:db8::1]:7448", "127.0.0.1") == "127.0.0.1"  # chosen: kept


@needs_ipv6
@pytest.mark.parametrize(
    ("dialer_host", "listener_host", "dialed"),
    [
        ("::1", "::1", "[::1]"),
        ("::", "::", "[::1]"),
        ("::", "::", "127.0.0.1"),  # an IPv4 peer of a dual-stack socket
        ("::", "127.0.0.1", "127.0.0.1"),
        ("127.0.0.1", "::", "127.0.0.1"),
    ],
)
async def test_ipv6_and_dual_stack_endpoints_dial_and_talk(dialer_host, listener_host, dialed):
    a_id, b_id = NodeIdentity.generate(), NodeIdentity.generate()
    b_rec = Recorder()
    a = await QuicEndpoint.listen(a_id, Recorder(), dialer_host, 0)
    b = await QuicEndpoint.listen(b_id, b_rec, listener_host, 0)
    try:
        link = await a.dial(f"{dialed}:{b.local_address[1]}", b_id.node_id, timeout=10)
        stream = await link.open_raw_stream()
        await stream.write(b"hello over v6")
        remote = await b_rec.next_stream()
        assert remote.peer_id == a_id.node_id and await remote.read() == b"hello over v6"
        assert link.description == f"quic {dialed}:{b.local_address[1]}"
    finally:
        a.close()
        b.close()
        await asyncio.sleep(0.01)


@needs_ipv6
async def test_an_ipv4_only_node_says_why_it_cannot_dial_an_ipv6_peer():
    a = await QuicEndpoint.listen(NodeIdentity.generate(), Recorder(), "127.0.0.1", 0)
    try:
        with pytest.raises(DialError, match=r"IPv6 address and this node listens on IPv4 only"):
            await a.dial("[::1]:9", NodeIdentity.generate().node_id, timeout=5)
    finally:
        a.close()


@needs_ipv6
async def test_nodes_on_ipv6_join_and_gossip(tmp_path):
    first = first_member(tmp_path / "a", fast_config(listen="[::1]:0"), MeshKey.generate())
    await first.start()
    joiner = Node(
        NodeIdentity.generate(),
        DataDir(tmp_path / "b"),
        fast_config(listen="[::]:0"),
        invite=invite_from(first),
    )
    try:
        assert first.addresses[0].startswith("[::1]:")
        await joiner.start()
        await joiner.join()
        await eventually(lambda: joiner.node_id in first.state.table and first.node_id in joiner.state.table)
        assert await first.probe(joiner.node_id) and await joiner.probe(first.node_id)
    finally:
        await joiner.shutdown()
        await first.shutdown()


@needs_ipv6
async def test_a_relay_at_an_ipv6_address_carries_nodes_that_listen_on_ipv4(tmp_path):
    mesh_key = MeshKey.generate()
    server = RelayServer(NodeIdentity.generate(), {mesh_key.mesh_id})
    await server.start("::1", 0)
    relay = Endpoint(server.relay_id, f"[::1]:{server.address[1]}")
    first = first_member(tmp_path / "a", relay_only_config(relay), mesh_key)
    joiner: Node | None = None
    try:
        await first.start()
        invite = invite_from(first, relays=first.state.membership.relays)
        joiner = Node(NodeIdentity.generate(), DataDir(tmp_path / "b"), relay_only_config(), invite=invite)
        await joiner.start()
        await joiner.join()
        await eventually(lambda: joiner.node_id in first.state.table)
        assert await first.probe(joiner.node_id)
        assert first.status().node.relays[0].registered
    finally:
        if joiner is not None:
            await joiner.shutdown()
        await first.shutdown()
        await server.close()


def test_a_wildcard_listener_advertises_an_address_of_each_family_it_serves():
    assert advertised_hosts("0.0.0.0", "192.0.2.2", "fd00::2") == ["192.0.2.2"]
    assert advertised_hosts("0.0.0.0", None, "fd00::2") == ["127.0.0.1"]
    assert advertised_hosts("::", "192.0.2.2", "fd00::2") == ["192.0.2.2", "fd00::2"]
    # An IPv6-only host: it used to advertise 127.0.0.1, which no peer can dial.
    assert advertised_hosts("::", None, "fd00::2") == ["fd00::2"]
    assert advertised_hosts("::", None, None) == ["::1"]
    assert advertised_hosts("10.1.2.3", "192.0.2.2", None) == ["10.1.2.3"]


@needs_ipv6
async def test_a_dual_stack_node_advertises_what_this_machine_routes(tmp_path):
    node = first_member(tmp_path / "a", fast_config(listen="[::]:0"), MeshKey.generate())
    await node.start()
    try:
        port = node.endpoint.local_address[1]
        expected = advertised_hosts("::", outbound_address(socket.AF_INET), outbound_address(socket.AF_INET6))
        assert node.addresses == [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in expected]
    finally:
        await node.shutdown()


@needs_ipv6
async def test_a_dual_stack_node_dials_a_name_with_both_records_at_its_ipv4_address(monkeypatch):
    # The default --listen is 0.0.0.0: a peer's name with an AAAA record first must not be dialed
    # at the IPv6 address its node does not listen on.
    b_id = NodeIdentity.generate()
    a = await QuicEndpoint.listen(NodeIdentity.generate(), Recorder(), "::", 0)
    b = await QuicEndpoint.listen(b_id, Recorder(), "127.0.0.1", 0)
    port = b.local_address[1]

    async def both_records(host, port_, **kwargs):
        assert host == "peer.example"
        return [
            (socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", port_, 0, 0)),
            (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.0.1", port_)),
        ]

    monkeypatch.setattr(a.loop, "getaddrinfo", both_records)
    try:
        link = await a.dial(f"peer.example:{port}", b_id.node_id, timeout=5)
        assert link.description == f"quic 127.0.0.1:{port}"
    finally:
        a.close()
        b.close()
        await a.wait_closed()
        await b.wait_closed()
