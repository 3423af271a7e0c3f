"""Relay client and manager pieces that need no network: backoff, bounded per-peer state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from helpers.mesh_nodes import start_relay_server
from relay_helpers import EchoHandler, new_member

from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, MeshKey
from meshnode.relaylink.client import MAX_RELAY_ADDRESSES, Backoff, RelayCheck, RelayClientConfig
from meshnode.relaylink.manager import RelayDialError, RelayLinkConfig, RelayLinks
from meshnode.relaylink.seal import CONTROL_CHANNEL, KIND_INIT, KIND_RESPONSE, PeerSealer
from meshnode.relaywire.protocol import relay


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    backoff = Backoff(initial=0.2, cap=5.0, rng=lambda: 1.0)
    assert [round(backoff.next(), 3) for _ in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    low = Backoff(initial=0.2, cap=5.0, rng=lambda: 0.0)
    assert [round(low.next(), 3) for _ in range(3)] == [0.1, 0.2, 0.4]  # never below half the ceiling
    backoff.reset()
    assert backoff.next() == pytest.approx(0.2)


@dataclass
class FakeClient:
    """Stands in for a RelayClient: only what RelayLinks reads of one (hence the type ignores)."""

    relay_id: bytes = b"\x09" * 32
    sent: list[tuple[bytes, int, bytes]] = field(default_factory=list)

    def send(self, destination: bytes, channel: int, payload: bytes) -> None:
        self.sent.append((destination, channel, payload))


class NullHandler:
    def link_established(self, link) -> None: ...
    def stream_accepted(self, link, stream) -> None: ...
    def link_closed(self, link, reason) -> None: ...


async def test_per_peer_state_is_bounded_and_idle_peers_are_evicted() -> None:
    me = NodeIdentity.generate()
    links = RelayLinks(
        me, NullHandler(), mesh_id="m", proof_for=lambda _r: None, settings=RelayLinkConfig(max_peers=2)
    )
    client = FakeClient()
    senders = [NodeIdentity.generate() for _ in range(3)]
    for sender in senders:
        init = PeerSealer(sender, me.node_id).start()
        links.client_callbacks.deliver(client, sender.node_id, CONTROL_CHANNEL, init)  # type: ignore[arg-type]  # a fake client
    # Every handshake was answered, but only two peers' state is kept: the oldest idle one went.
    assert [destination for destination, _, _ in client.sent] == [s.node_id for s in senders]
    assert links.sealed_peers() == {senders[1].node_id, senders[2].node_id}


async def test_garbage_from_a_member_is_dropped_and_counted() -> None:
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    links = RelayLinks(me, NullHandler(), mesh_id="m", proof_for=lambda _r: None)
    client = FakeClient()
    links.client_callbacks.deliver(client, other.node_id, 4, b"\x04" + b"\0" * 40)  # type: ignore[arg-type]  # a fake client
    links.client_callbacks.deliver(client, other.node_id, 4, b"")  # type: ignore[arg-type]  # a fake client
    assert links.frames_dropped == 2


@dataclass
class RegisteredClient(FakeClient):
    registered: bool = True
    endpoint_info: str = "relay-under-test"


async def test_a_dial_the_relay_refused_does_not_make_us_ignore_the_peers_own_handshake() -> None:
    # After a relay restart the lower-id node re-registered first and dialed its peer; the
    # relay refused (peer not registered yet). The peer's own INIT must then be answered,
    # not dropped as the loser of a simultaneous handshake against a dead initiation.
    me, other = sorted((NodeIdentity.generate(), NodeIdentity.generate()), key=lambda i: i.node_id)
    links = RelayLinks(me, NullHandler(), mesh_id="m", proof_for=lambda _r: None)
    client = RegisteredClient()
    # A fake registered relay client, put where add_relays would put a real one (which dials): the
    # manager has no public way to take a client it did not make.
    links._clients[client.relay_id] = client  # type: ignore[assignment]  # a fake client

    dial = asyncio.create_task(links.open_link(other.node_id, timeout=5.0))
    while not client.sent:
        await asyncio.sleep(0)
    assert client.sent[0][2][0] == KIND_INIT
    refusal = relay.RelaySendRefused(
        destination_id=other.node_id,
        channel=CONTROL_CHANNEL,
        refusal=relay.RelayRefusal(code=relay.RELAY_ERROR_DESTINATION_UNKNOWN, detail="not registered here"),
    )
    links.client_callbacks.send_refused(client, refusal)  # type: ignore[arg-type]  # a fake client
    with pytest.raises(RelayDialError, match="refused"):
        await dial

    client.sent.clear()
    their_init = PeerSealer(other, me.node_id).start()
    links.client_callbacks.deliver(client, other.node_id, CONTROL_CHANNEL, their_init)  # type: ignore[arg-type]  # a fake client
    assert [(destination, payload[0]) for destination, _, payload in client.sent] == [
        (other.node_id, KIND_RESPONSE)
    ]


def inits_sent(client: RegisteredClient) -> list[bytes]:
    return [destination for destination, channel, payload in client.sent if payload[0] == KIND_INIT]


async def test_a_dial_avoiding_a_relay_goes_through_another_and_that_relay_comes_last_until_it_delivers() -> (
    None
):
    # A relay that died without closing still counts as registered for 15 s: a peer that stopped
    # answering through it is dialed through another, and so is every other peer, until it delivers.
    me = NodeIdentity.generate()
    links = RelayLinks(me, NullHandler(), mesh_id="m", proof_for=lambda _r: None)
    silent, other = RegisteredClient(relay_id=b"\x01" * 32), RegisteredClient(relay_id=b"\x02" * 32)
    for client in (silent, other):
        links._clients[client.relay_id] = client  # type: ignore[assignment]  # a fake client
    both = [silent.relay_id, other.relay_id]
    peers = [NodeIdentity.generate().node_id for _ in range(3)]

    dials = [asyncio.create_task(links.open_link(peers[0], via=both, timeout=5.0))]
    await asyncio.sleep(0)
    assert inits_sent(silent) == [peers[0]] and inits_sent(other) == []  # first choice: announced first

    dials.append(
        asyncio.create_task(links.open_link(peers[0], via=both, avoid=[silent.relay_id], timeout=5.0))
    )
    dials.append(asyncio.create_task(links.open_link(peers[1], via=both, timeout=5.0)))
    await asyncio.sleep(0)
    assert inits_sent(other) == [peers[0], peers[1]] and inits_sent(silent) == [peers[0]]

    # Any payload through the silent relay shows it alive: it is the first choice again.
    links.client_callbacks.deliver(silent, peers[1], 4, b"\x04" + b"\0" * 40)  # type: ignore[arg-type]  # a fake client
    dials.append(asyncio.create_task(links.open_link(peers[2], via=both, timeout=5.0)))
    await asyncio.sleep(0)
    assert inits_sent(silent) == [peers[0], peers[2]]
    for dial in dials:
        dial.cancel()
    await asyncio.gather(*dials, return_exceptions=True)


async def test_a_dial_avoiding_the_only_relay_goes_through_it_at_once() -> None:
    # A probe's second chance avoids the relay its peer went silent through; with no other
    # relay it used to fail at once, and a peer only slow to answer (a lossy path through a
    # live relay, the NAT lab under 20% loss) was dropped. It goes through that relay again.
    me = NodeIdentity.generate()
    links = RelayLinks(
        me,
        NullHandler(),
        mesh_id="m",
        proof_for=lambda _r: None,
        settings=RelayLinkConfig(registration_wait=60),
    )
    only = RegisteredClient()
    links._clients[only.relay_id] = only  # type: ignore[assignment]  # a fake client
    peer = NodeIdentity.generate().node_id
    dial = asyncio.create_task(links.open_link(peer, via=[only.relay_id], avoid=[only.relay_id], timeout=5.0))
    # Not after registration_wait: no other relay is coming up.
    async with asyncio.timeout(10):
        while not only.sent:
            await asyncio.sleep(0)
    assert only.sent[0][0] == peer and only.sent[0][2][0] == KIND_INIT
    dial.cancel()
    await asyncio.gather(dial, return_exceptions=True)


async def test_relays_announced_by_peers_are_bounded_and_an_idle_one_makes_room() -> None:
    # An admitted member may announce ever new relays; each one this node registered with
    # cost a UDP socket and a registration loop, for good.
    me = NodeIdentity.generate()
    settings = RelayLinkConfig(max_peer_relays=2)
    links = RelayLinks(me, NullHandler(), mesh_id="m", proof_for=lambda _r: None, settings=settings)
    own = Endpoint(bytes([1]) * 32, "127.0.0.1:9")
    announced = [Endpoint(bytes([n]) * 32, "127.0.0.1:9") for n in (2, 3, 4, 5)]
    try:
        await links.add_relays([own])
        await links.add_peer_relays(announced[:2])
        assert [r.id for r in links.relays] == [own.id, announced[0].id, announced[1].id]
        # A handshake in progress through the oldest keeps it; the next idle one makes room.
        links._pending[(announced[0].id, b"\x07" * 32)] = asyncio.get_running_loop().create_future()
        await links.add_peer_relays(announced[2:3])
        assert [r.id for r in links.relays] == [own.id, announced[0].id, announced[2].id]
        # Every peer relay busy: the new one is not registered with (ours never counts or goes).
        links._pending[(announced[2].id, b"\x07" * 32)] = asyncio.get_running_loop().create_future()
        await links.add_peer_relays(announced[3:])
        assert [r.id for r in links.relays] == [own.id, announced[0].id, announced[2].id]
    finally:
        for future in links._pending.values():
            future.cancel()
        await links.close()


async def test_a_relay_that_moved_is_reached_at_the_address_peers_announce_for_it() -> None:
    # A node whose stored address for its relay went stale kept dialing it; peers that know the
    # new address announce it, and the relay's key is what is checked, wherever it answers.
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    member = new_member(mesh_key)
    settings = RelayLinkConfig(client=RelayClientConfig(connect_timeout=0.3, backoff_initial=0.05))
    links = RelayLinks(
        member.identity,
        EchoHandler(),
        mesh_id=member.mesh_id,
        proof_for=lambda _relay_id: member.proof,
        settings=settings,
        local_host="127.0.0.1",
    )
    stale = Endpoint(relay.id, "127.0.0.1:9")
    try:
        await links.add_relays([stale])
        await links.add_peer_relays([relay])  # as a peer's announcement names it
        await links.wait_registered(10)
        assert links.registered_relays() == [relay]
        client = links.client(relay.id)
        assert client is not None and client.addresses == [stale.address, relay.address]
        # Bounded: a member may announce any number of addresses.
        for port in range(10, 20):
            client.consider_address(f"127.0.0.1:{port}")
        assert len(client.addresses) == MAX_RELAY_ADDRESSES and client.addresses[0] == stale.address
    finally:
        await links.close()
        await server.close(flush_timeout=0.3)


async def test_a_relay_that_answers_its_ping_is_kept_and_one_we_do_not_use_is_away() -> None:
    # Checking a relay that is fine must not cost its registration (and every link through it).
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    member = new_member(mesh_key)
    links = RelayLinks(
        member.identity,
        EchoHandler(),
        mesh_id=member.mesh_id,
        proof_for=lambda _relay_id: member.proof,
        local_host="127.0.0.1",
    )
    try:
        await links.add_relays([relay])
        await links.wait_registered(10)
        client = links.client(relay.id)
        assert client is not None and client.registrations == 1
        assert await links.confirm_relay(relay.id, 2.0) is RelayCheck.ANSWERED
        assert client.registrations == 1 and client.registered
        assert await links.confirm_relay(b"\x01" * 32, 2.0) is RelayCheck.AWAY
    finally:
        await links.close()
        await server.close(flush_timeout=0.3)
