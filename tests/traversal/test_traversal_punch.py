"""Hole punching between two in-process nodes that cannot dial each other (loopback, real QUIC,
a real relay): their announced addresses lead nowhere, so they meet through the relay, and the
relay observes where their sockets really are, which is where they punch to."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.mesh_nodes import (
    first_member,
    invite_from,
    relay_only_config,
    start_invited_node,
    start_relay_server,
)
from helpers.polling import eventually

from meshnode.app.status import format_status
from meshnode.gen.meshnode.v1 import traversal_pb2 as traversal
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.metrics import MetricSources, collect, samples_by_name
from meshnode.node import Node, NodeConfig
from meshnode.transport.base import StreamReset
from meshnode.transport.quic import QuicEndpoint
from meshnode.traversal import punch_messages
from meshnode.traversal.config import TraversalConfig
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import reset_code
from meshnode.wire.pb import mesh
from relay.server import RelayServer

pytestmark = pytest.mark.timeout(60)

# Announced, and dialled first by a joiner: nothing answers there.
NOWHERE = "127.0.0.1:9"


def natted(relay: Endpoint, *, punching: bool = True, **traversal: Any) -> NodeConfig:
    """A node its peers cannot dial at the address it announces (as behind NAT), that may dial."""
    return relay_only_config(
        relay,
        relay_only=False,
        advertise=[NOWHERE],
        connect_timeout=1.0,
        traversal=TraversalConfig(hole_punching=punching, **traversal),
    )


@dataclass
class Pair:
    relay: RelayServer
    a: Node
    b: Node


@pytest.fixture
async def pair_factory(tmp_path: Path) -> AsyncIterator:
    made: list[Node] = []
    servers: list[RelayServer] = []

    async def make(
        config_a: Callable[[Endpoint], NodeConfig] | None = None,
        config_b: Callable[[Endpoint], NodeConfig] | None = None,
    ) -> Pair:
        mesh_key = MeshKey.generate()
        server, relay = await start_relay_server(mesh_key)
        servers.append(server)
        a = first_member(tmp_path / "a", config_a(relay) if config_a else natted(relay), mesh_key)
        made.append(a)
        await a.start()
        await eventually(lambda: a.relay_links is not None and a.relay_links.registered_relays(), 20)
        b = await start_invited_node(
            tmp_path / "b",
            config_b(relay) if config_b else natted(relay),
            invite_from(a, relays=[relay]),
        )
        made.append(b)
        await eventually(lambda: a.node_id in b.state.table and b.node_id in a.state.table, 20)
        return Pair(server, a, b)

    yield make
    for node in made:
        await node.shutdown()
    for server in servers:
        await server.close()


def peer_status(node: Node, other: Node) -> dict:
    (peer,) = [p for p in node.status().to_json()["peers"] if p["id"] == other.node_id.hex()]
    return peer


def attempts(node: Node) -> dict[str, int]:
    return node.status().to_json()["sections"]["traversal"]["punch_attempts"]


def relayed_links(node: Node) -> list[object]:
    """The node's relayed links still open (kept or draining)."""
    assert node.relay_links is not None
    return [link for link in node.relay_links._links.values() if not link.is_closed]


def direct_both_ways(pair: Pair) -> bool:
    link_ab, link_ba = pair.a.link_to(pair.b.node_id), pair.b.link_to(pair.a.node_id)
    return (
        link_ab is not None and link_ba is not None and link_ab.relay_id is None and link_ba.relay_id is None
    )


async def test_relays_tell_each_node_where_they_see_its_own_socket(pair_factory) -> None:
    pair = await pair_factory()
    for node in (pair.a, pair.b):
        assert node.endpoint is not None
        port = node.endpoint.local_address[1]
        # Registered from the node's mesh socket: the relay sees that port, and the node announces it.
        assert pair.relay.member_addresses()[node.node_id] == f"127.0.0.1:{port}"
        status = node.status().to_json()["node"]
        assert status["observed_addresses"] == [f"127.0.0.1:{port}"]
        assert status["nat_mapping"] == "unknown"  # one relay cannot tell
        assert list(node.state.local.observed_addresses) == [f"127.0.0.1:{port}"]


async def test_two_nodes_that_meet_through_the_relay_punch_a_direct_path_and_leave_the_relay(
    pair_factory,
) -> None:
    pair = await pair_factory()
    await eventually(lambda: direct_both_ways(pair), 20)
    for node, other in ((pair.a, pair.b), (pair.b, pair.a)):
        await eventually(lambda n=node, o=other: peer_status(n, o)["path"] == "punched", 10)
    # The side that dialed the relayed link asked; the other answered and dialed.
    await eventually(
        lambda: {**attempts(pair.a), **attempts(pair.b)} == {"initiator direct": 1, "responder direct": 1}, 10
    )
    # The relayed link closes once drained, and the relay carries nothing more between them.
    await eventually(lambda: not relayed_links(pair.a) and not relayed_links(pair.b), 10)
    await asyncio.sleep(0.5)  # each side's CLOSE of the relayed link reaches the other
    relayed = peer_status(pair.a, pair.b)["relay_bytes"]
    assert relayed > 0
    await asyncio.sleep(1.0)  # three heartbeats: gossip goes over the direct path
    assert peer_status(pair.a, pair.b)["relay_bytes"] == relayed
    assert peer_status(pair.a, pair.b)["path"] == "punched"

    # What a person and a scraper see.
    shown = format_status(pair.a.status().to_json())
    assert f"quic 127.0.0.1:{pair.b.endpoint.local_address[1]} (punched, " in shown
    assert "(NAT mapping: unknown); hole punching on: " in shown
    samples = samples_by_name(await collect(MetricSources(node=pair.a), now=0.0))
    punches = {(s["role"], s["outcome"]): v for s, v in samples["meshnode_hole_punch_attempts_total"]}
    assert sum(punches.values()) == 1 and {outcome for _role, outcome in punches} == {"direct"}
    carried = {(s["path"], s["direction"]): v for s, v in samples["meshnode_link_bytes_total"]}
    assert carried[("direct", "sent")] > 0 and carried[("relayed", "sent")] > 0


async def test_a_node_with_punching_off_declines_and_the_pair_stays_relayed(pair_factory) -> None:
    pair = await pair_factory(config_a=lambda relay: natted(relay, punching=False))
    # B joined, so B dialed the relayed link and asks; A says no.
    await eventually(lambda: attempts(pair.b).get("initiator declined", 0) >= 1, 10)
    assert attempts(pair.a) == {"responder declined": attempts(pair.b)["initiator declined"]}
    await asyncio.sleep(1.5)  # past the round's 1 s retry gap
    assert attempts(pair.b) == {"initiator declined": 1}  # backing off, not asking again
    assert peer_status(pair.a, pair.b)["path"] == "relayed"
    assert pair.a.status().to_json()["node"]["hole_punching"] == "off"


async def test_an_offer_of_addresses_the_peers_record_does_not_announce_makes_no_datagram(
    pair_factory,
) -> None:
    # B does not punch of its own accord; the test speaks for it on its relayed link.
    pair = await pair_factory(config_b=lambda relay: natted(relay, punching=False))
    trap = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    trap.bind(("127.0.0.1", 0))
    trap.setblocking(False)
    try:
        victim = f"127.0.0.1:{trap.getsockname()[1]}"
        link = await pair.b.get_link(pair.a.node_id)
        assert link.relay_id is not None
        stream = await link.open_stream(StreamType.HOLE_PUNCH)
        await stream.send_frame(punch_messages.offer([victim], mesh.NAT_MAPPING_UNKNOWN))
        answer = punch_messages.read(await stream.recv_frame(5.0), expect=("declined",))
        assert answer.declined.reason == traversal.PUNCH_DECLINE_NO_CANDIDATES
        await asyncio.sleep(0.5)
        with pytest.raises(BlockingIOError):
            trap.recvfrom(2048)  # nothing was sent to the address B named

        # An offer breaking the rules is refused with the exact code.
        stream = await link.open_stream(StreamType.HOLE_PUNCH)
        await stream.send_frame(
            punch_messages.offer([], mesh.NAT_MAPPING_UNKNOWN)[:0] + _too_many_candidates()
        )
        with pytest.raises(StreamReset) as refused:
            await stream.recv_frame(5.0)
        assert refused.value.error_code == reset_code(mesh.MESH_ERROR_MALFORMED)
    finally:
        trap.close()


def _too_many_candidates() -> bytes:
    offer = traversal.PunchOffer(gen=1, candidates=[f"127.0.0.1:{1000 + i}" for i in range(9)])
    return traversal.PunchMessage(offer=offer).SerializeToString()


async def test_a_direct_path_that_goes_silent_is_given_up_for_the_relay_and_not_punched_again_at_once(
    pair_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fast(relay: Endpoint) -> NodeConfig:
        return natted(relay, ping_after_s=0.3, silent_after_s=1.5)

    pair = await pair_factory(config_a=fast, config_b=fast)
    # Each side counts its attempt when the attempt ends, which can come just after the link is up.
    await eventually(lambda: direct_both_ways(pair) and attempts(pair.a) and attempts(pair.b), 20)
    before = {**attempts(pair.a), **attempts(pair.b)}
    assert pair.a.endpoint is not None and pair.b.endpoint is not None
    a_port = pair.a.endpoint.local_address[1]
    relay_port = pair.relay.address[1]
    sendto = QuicEndpoint.sendto

    def b_reaches_only_the_relay(endpoint: QuicEndpoint, data: bytes, addr: tuple[str, int]) -> None:
        # B's datagrams to A's socket are lost from now on; its relay registration still works.
        if endpoint is pair.b.endpoint and addr[1] == a_port and addr[1] != relay_port:
            return
        sendto(endpoint, data, addr)

    monkeypatch.setattr(QuicEndpoint, "sendto", b_reaches_only_the_relay)

    def relayed_both_ways() -> bool:
        link_ab, link_ba = pair.a.link_to(pair.b.node_id), pair.b.link_to(pair.a.node_id)
        return (
            link_ab is not None
            and link_ba is not None
            and link_ab.relay_id is not None
            and link_ba.relay_id is not None
        )

    await eventually(relayed_both_ways, 15)
    lost = {
        node: node.status().to_json()["sections"]["traversal"]["direct_paths_lost"]
        for node in (pair.a, pair.b)
    }
    assert sum(lost.values()) >= 1
    assert pair.a.node_id in pair.b.state.table and pair.b.node_id in pair.a.state.table
    await asyncio.sleep(1.5)
    # The pair backs off (60 s by default) rather than punching again into the same hole.
    assert {**attempts(pair.a), **attempts(pair.b)} == before
