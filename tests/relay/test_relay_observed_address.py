"""A node registers from its mesh socket, and the relay tells it where it sees that socket: at
registration, and again when the node's NAT maps it to another port (real QUIC, a real relay, a
UDP forwarder standing in for the NAT)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from helpers.mesh_nodes import start_relay_server
from helpers.polling import eventually
from relay_helpers import new_member

from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.quic import QuicEndpoint

pytestmark = pytest.mark.timeout(30)


class NullHandler:
    def link_established(self, link) -> None: ...
    def stream_accepted(self, link, stream) -> None: ...
    def link_closed(self, link, reason) -> None: ...


class RemappingNat(asyncio.DatagramProtocol):
    """Forwards one inside host's datagrams to ``target`` from an outside socket of its own, and
    the replies back; :meth:`remap` moves the outside socket to a new port, as a NAT does when a
    mapping expires or is renumbered."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.inside: asyncio.DatagramTransport | None = None
        self.inside_peer: tuple[str, int] | None = None
        self.outside: asyncio.DatagramTransport | None = None

    @classmethod
    async def start(cls, target: tuple[str, int]) -> RemappingNat:
        nat = cls(target)
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: nat, local_addr=("127.0.0.1", 0))
        await nat.remap()
        return nat

    @property
    def port(self) -> int:
        assert self.inside is not None
        return self.inside.get_extra_info("sockname")[1]

    @property
    def outside_port(self) -> int:
        assert self.outside is not None
        return self.outside.get_extra_info("sockname")[1]

    async def remap(self) -> None:
        old = self.outside
        nat = self

        class Outside(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                if nat.inside is not None and nat.inside_peer is not None:
                    nat.inside.sendto(data, nat.inside_peer)

        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Outside, local_addr=("127.0.0.1", 0)
        )
        self.outside = transport
        if old is not None:
            old.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inside = transport  # type: ignore[assignment]  # a datagram endpoint's (uvloop's is no DatagramTransport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.inside_peer = addr
        if self.outside is not None:
            self.outside.sendto(data, self.target)

    def close(self) -> None:
        for transport in (self.inside, self.outside):
            if transport is not None:
                transport.close()


async def test_the_relay_tells_a_node_where_it_sees_its_socket_and_again_after_a_remap() -> None:
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    nat = await RemappingNat.start(("127.0.0.1", server.address[1]))
    member = new_member(mesh_key)
    node_socket = await QuicEndpoint.listen(member.identity, NullHandler(), "127.0.0.1", 0)
    changes: list[dict[bytes, str]] = []
    links: RelayLinks | None = None

    def observed() -> None:
        assert links is not None
        changes.append(links.observed_addresses())

    links = RelayLinks(
        member.identity,
        NullHandler(),
        mesh_id=mesh_key.mesh_id,
        proof_for=lambda _relay: member.proof,
        node_endpoint=node_socket,
        on_observed=observed,
    )
    try:
        await links.add_relays([Endpoint(relay.id, f"127.0.0.1:{nat.port}")])
        await links.wait_registered(10)
        await eventually(lambda: changes, 5)
        first = f"127.0.0.1:{nat.outside_port}"
        assert changes == [{relay.id: first}]
        # The registration left from the node's own socket, through the NAT.
        client = links.client(relay.id)
        assert client is not None and client.shares_node_socket
        assert server.member_addresses()[member.node_id] == first

        await nat.remap()
        assert client.session is not None
        client.session.link.ping()  # traffic, so the relay sees the new port
        second = f"127.0.0.1:{nat.outside_port}"
        await eventually(lambda: len(changes) == 2, 10)
        assert changes[1] == {relay.id: second} and second != first
        assert server.member_addresses()[member.node_id] == second
        assert client.registrations == 1  # the same registration, followed to its new address
    finally:
        await links.close()
        node_socket.close()
        nat.close()
        with contextlib.suppress(Exception):
            await server.close()


async def test_a_relay_the_node_socket_cannot_reach_is_dialed_from_a_socket_of_its_own() -> None:
    loopback = await QuicEndpoint.listen(
        new_member(MeshKey.generate()).identity, NullHandler(), "127.0.0.1", 0
    )
    wildcard = await QuicEndpoint.listen(new_member(MeshKey.generate()).identity, NullHandler(), "0.0.0.0", 0)
    try:
        # A loopback socket reaches only loopback; an IPv4 socket no IPv6 literal.
        assert loopback.can_dial("127.0.0.1:7448") and not loopback.can_dial("198.51.100.7:7448")
        assert wildcard.can_dial("198.51.100.7:7448") and not wildcard.can_dial("[2001:db8::7]:7448")
    finally:
        loopback.close()
        wildcard.close()
