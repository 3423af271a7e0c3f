"""How a node reaches a peer: the dial plan (pure), then direct dials and the relays in turn."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from helpers.mesh_helpers import FakeLink

from meshnode.membership.credentials import Endpoint
from meshnode.mesh.peer_dialer import PeerDialer, PeerUnreachable, dial_plan
from meshnode.mesh.peer_links import PeerLinks
from meshnode.transport.base import PeerLink
from meshnode.transport.quic import DialError
from meshnode.wire.pb import mesh

A, B, C = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
RELAY = b"\x09" * 32


def announcement(
    *addresses: str, reachable: bool = True, relays: Iterable[bytes] = ()
) -> mesh.PeerAnnouncement:
    return mesh.PeerAnnouncement(
        endpoint_id=B,
        addresses=list(addresses),
        directly_reachable=reachable,
        relays=[mesh.RelayEndpoint(relay_id=r, address="relay:1") for r in relays],
    )


# -- the plan --------------------------------------------------------------------------------------------


def test_announced_addresses_come_first_then_the_known_ones_for_that_peer():
    known = [Endpoint(B, "10.0.0.2:1"), Endpoint(C, "10.0.0.3:1"), Endpoint(B, "10.0.0.9:1")]
    plan = dial_plan(B, announcement("10.0.0.2:1", "10.0.0.5:1"), known, relay_only=False)
    assert plan.addresses == ("10.0.0.2:1", "10.0.0.5:1", "10.0.0.9:1")


def test_a_peer_not_in_the_table_is_dialed_at_its_known_addresses_with_no_relay_of_its_own():
    plan = dial_plan(B, None, [Endpoint(B, "10.0.0.2:1")], relay_only=False)
    assert plan.addresses == ("10.0.0.2:1",) and plan.relays == ()


def test_a_peer_behind_nat_is_reached_only_through_the_relays_it_announces():
    plan = dial_plan(B, announcement("10.0.0.2:1", reachable=False, relays=[RELAY]), [], relay_only=False)
    assert plan.addresses == () and plan.relays == (Endpoint(RELAY, "relay:1"),)


def test_relay_only_dials_nothing_directly():
    plan = dial_plan(B, announcement("10.0.0.2:1"), [Endpoint(B, "10.0.0.3:1")], relay_only=True)
    assert plan.addresses == ()


# -- carrying it out -------------------------------------------------------------------------------------


class Direct:
    def __init__(self, answers: dict[str, PeerLink]) -> None:
        self.answers = answers
        self.dialed: list[str] = []

    async def dial(self, address: str, expected_peer_id: bytes, timeout: float | None = None) -> PeerLink:
        self.dialed.append(address)
        if address not in self.answers:
            raise DialError(f"no answer from {address}")
        return self.answers[address]


class Relays:
    def __init__(self, link: PeerLink | None = None) -> None:
        self.link = link
        self.added: list[Endpoint] = []
        self.opened: list[tuple[bytes, list[bytes]]] = []
        self.avoided: list[list[bytes]] = []

    async def add_peer_relays(self, endpoints: Iterable[Endpoint]) -> None:
        self.added.extend(endpoints)

    async def open_link(
        self,
        peer_id: bytes,
        *,
        via: Iterable[bytes] = (),
        avoid: Iterable[bytes] = (),
        timeout: float | None = None,
    ) -> PeerLink:
        self.opened.append((peer_id, list(via)))
        self.avoided.append(list(avoid))
        if self.link is None:
            raise ConnectionError("not registered with a relay the peer uses")
        return self.link


def dialer(
    direct: Direct,
    relays: Relays | None,
    *,
    peer: mesh.PeerAnnouncement | None = None,
    known: list[Endpoint] | None = None,
    relay_only: bool = False,
    links: PeerLinks | None = None,
) -> PeerDialer:
    table = {B: peer} if peer is not None else {}
    return PeerDialer(
        links or PeerLinks(A, race_window=2.0),
        direct,
        relays,
        announcement_of=table.get,
        known_peers=lambda: known or [],
        connect_timeout=1.0,
        relay_only=relay_only,
    )


async def test_each_address_is_tried_in_turn_before_the_relays():
    link = FakeLink(B, dialed_here=True, at=1.0)
    direct = Direct({"10.0.0.5:1": link})
    relays = Relays()
    got = await dialer(direct, relays, peer=announcement("10.0.0.2:1", "10.0.0.5:1")).dial_peer(B)
    assert got is link and direct.dialed == ["10.0.0.2:1", "10.0.0.5:1"] and relays.opened == []


async def test_when_no_address_answers_the_peers_relays_are_registered_with_and_used():
    relayed = FakeLink(B, dialed_here=True, at=1.0)
    relays = Relays(relayed)
    peer = announcement("10.0.0.2:1", relays=[RELAY])
    assert await dialer(Direct({}), relays, peer=peer).dial_peer(B) is relayed
    assert relays.added == [Endpoint(RELAY, "relay:1")] and relays.opened == [(B, [RELAY])]


async def test_a_relay_the_peer_stopped_answering_through_is_passed_on_as_avoided():
    relays = Relays(FakeLink(B, dialed_here=True, at=1.0))
    peer = announcement(relays=[RELAY])
    await dialer(Direct({}), relays, peer=peer).dial_peer(B)
    await dialer(Direct({}), relays, peer=peer).dial_peer(B, avoid_relays=[RELAY])
    assert relays.avoided == [[], [RELAY]]


async def test_an_unreachable_peer_names_every_attempt():
    with pytest.raises(PeerUnreachable) as failed:
        await dialer(Direct({}), Relays(), peer=announcement("10.0.0.2:1")).dial_peer(B)
    message = str(failed.value)
    assert "10.0.0.2:1: no answer from 10.0.0.2:1" in message
    assert "relay: not registered with a relay the peer uses" in message
    with pytest.raises(PeerUnreachable, match="no address"):
        await dialer(Direct({}), None).dial_peer(B)


async def test_a_direct_dial_that_lost_a_simultaneous_dial_returns_the_kept_link():
    links = PeerLinks(A, race_window=2.0)
    theirs = FakeLink(B, dialed_here=False, at=1.0)
    links.add(theirs)
    ours = FakeLink(B, dialed_here=True, at=1.1)
    direct = Direct({"10.0.0.2:1": ours})
    assert await dialer(direct, None, known=[Endpoint(B, "10.0.0.2:1")], links=links).dial_peer(B) is theirs


async def test_a_bootstrap_peer_is_dialed_then_reached_through_our_relays():
    relayed = FakeLink(B, dialed_here=True, at=1.0)
    relays = Relays(relayed)
    assert await dialer(Direct({}), relays).dial_endpoint(Endpoint(B, "10.0.0.2:1")) is relayed
    assert relays.opened == [(B, [])]  # any relay of ours: the peer's are not known yet
    # An invite's relays, where the inviting node registers, come first (a joiner's own may not reach it).
    await dialer(Direct({}), relays).dial_endpoint(Endpoint(B, "10.0.0.2:1"), via=[RELAY])
    assert relays.opened[-1] == (B, [RELAY])


async def test_a_bootstrap_peer_reached_neither_way_is_a_dial_error_naming_both():
    with pytest.raises(DialError, match=r"no answer from 10\.0\.0\.2:1; relay: not registered"):
        await dialer(Direct({}), Relays()).dial_endpoint(Endpoint(B, "10.0.0.2:1"))
    with pytest.raises(DialError, match=r"^direct dial disabled \(--relay-only\)$"):
        await dialer(Direct({}), None, relay_only=True).dial_endpoint(Endpoint(B, "10.0.0.2:1"))


# -- the LAN shortcut ---------------------------------------------------------------------------------


class Lan:
    """The addresses of a peer behind our router, and the failures reported."""

    def __init__(self, *addresses: str) -> None:
        self.listed = list(addresses)
        self.failures: list[str] = []

    def addresses(self, peer_id: bytes) -> list[str]:
        return self.listed

    def failed(self, peer_id: bytes, reason: str) -> None:
        self.failures.append(reason)


class SlowRelays(Relays):
    """Relays whose handshake takes a while."""

    async def open_link(self, peer_id: bytes, **kwargs: Any) -> PeerLink:
        self.opened.append((peer_id, list(kwargs.get("via", ()))))
        await asyncio.sleep(0.2)
        assert self.link is not None
        return self.link


def lan_dialer(direct: Direct, relays: Relays, lan: Lan) -> PeerDialer:
    peer = announcement("192.168.1.5:7447", reachable=False, relays=[RELAY])
    return PeerDialer(
        PeerLinks(A, race_window=2.0),
        direct,
        relays,
        announcement_of={B: peer}.get,
        known_peers=list,
        connect_timeout=1.0,
        relay_only=False,
        shortcuts=lan,
    )


async def test_a_peer_behind_our_router_is_dialed_at_its_private_address_beside_the_relay():
    on_lan = FakeLink(B, dialed_here=True, at=1.0, name="lan")
    relays = SlowRelays(FakeLink(B, dialed_here=True, at=1.0, name="relayed"))
    direct = Direct({"192.168.1.5:7447": on_lan})
    assert await lan_dialer(direct, relays, Lan("192.168.1.5:7447")).dial_peer(B) is on_lan
    # The relay's handshake ran beside it (a direct link that comes later replaces a relayed one).
    assert relays.opened == [(B, [RELAY])] and direct.dialed == ["192.168.1.5:7447"]


async def test_when_the_private_address_does_not_answer_the_relay_serves_and_the_failure_is_told():
    relayed = FakeLink(B, dialed_here=True, at=1.0, name="relayed")
    lan = Lan("192.168.1.5:7447")
    assert await lan_dialer(Direct({}), Relays(relayed), lan).dial_peer(B) is relayed
    await asyncio.sleep(0)
    assert lan.failures == ["192.168.1.5:7447: no answer from 192.168.1.5:7447"]
    # Nothing shared: the relay alone, no dial at all.
    direct = Direct({})
    assert await lan_dialer(direct, Relays(relayed), Lan()).dial_peer(B) is relayed
    assert direct.dialed == []
