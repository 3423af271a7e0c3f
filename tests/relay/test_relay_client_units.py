"""Relay client and manager pieces that need no network: backoff, bounded per-peer state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from meshnode.identity import NodeIdentity
from meshnode.relaylink.client import Backoff
from meshnode.relaylink.manager import RelayDialError, RelayLinks, RelayLinkSettings
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
        me, NullHandler(), mesh_id="m", proof_for=lambda _r: None, settings=RelayLinkSettings(max_peers=2)
    )
    client = FakeClient()
    senders = [NodeIdentity.generate() for _ in range(3)]
    for sender in senders:
        init = PeerSealer(sender, me.node_id).start()
        links.client_callbacks.deliver(client, sender.node_id, CONTROL_CHANNEL, init)  # type: ignore[arg-type]
    # Every handshake was answered, but only two peers' state is kept: the oldest idle one went.
    assert [destination for destination, _, _ in client.sent] == [s.node_id for s in senders]
    assert links.sealed_peers() == {senders[1].node_id, senders[2].node_id}


async def test_garbage_from_a_member_is_dropped_and_counted() -> None:
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    links = RelayLinks(me, NullHandler(), mesh_id="m", proof_for=lambda _r: None)
    client = FakeClient()
    links.client_callbacks.deliver(client, other.node_id, 4, b"\x04" + b"\0" * 40)  # type: ignore[arg-type]
    links.client_callbacks.deliver(client, other.node_id, 4, b"")  # type: ignore[arg-type]
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
    links._clients[client.relay_id] = client  # type: ignore[assignment]

    dial = asyncio.create_task(links.open_link(other.node_id, timeout=5.0))
    while not client.sent:
        await asyncio.sleep(0)
    assert client.sent[0][2][0] == KIND_INIT
    refusal = relay.RelaySendRefused(
        destination_id=other.node_id,
        channel=CONTROL_CHANNEL,
        refusal=relay.RelayRefusal(code=relay.RELAY_ERROR_DESTINATION_UNKNOWN, detail="not registered here"),
    )
    links.client_callbacks.send_refused(client, refusal)  # type: ignore[arg-type]
    with pytest.raises(RelayDialError, match="refused"):
        await dial

    client.sent.clear()
    their_init = PeerSealer(other, me.node_id).start()
    links.client_callbacks.deliver(client, other.node_id, CONTROL_CHANNEL, their_init)  # type: ignore[arg-type]
    assert [(destination, payload[0]) for destination, _, payload in client.sent] == [
        (other.node_id, KIND_RESPONSE)
    ]
