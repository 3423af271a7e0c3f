"""When a peer that left a probe unanswered gets a second probe, and around which relay."""

from __future__ import annotations

import asyncio

from meshnode.mesh.reprobe import (
    REFUSED_RETRY_INTERVAL_S,
    REFUSED_WITHIN_SHARE,
    Reprobe,
    heard_during_probe,
    reprobe_after,
    retry_refused_in,
)
from meshnode.transport.base import MeshStream, PeerLink

RELAY = b"\x07" * 32


class Link(PeerLink):
    def __init__(self, *, at: float, relay_id: bytes | None = None) -> None:
        self.peer_id = b"\x02" * 32
        self.initiated_locally = True
        self.established_at = at
        self.relay_id = relay_id
        self._closed = asyncio.Event()

    async def open_raw_stream(self) -> MeshStream:
        raise NotImplementedError

    def close(self, reason: str = "") -> None:
        self._closed.set()

    @property
    def description(self) -> str:
        return "test link"


async def test_a_silent_relayed_link_is_given_up_and_the_second_probe_goes_around_its_relay() -> None:
    relayed = Link(at=1.0, relay_id=RELAY)
    for current in (relayed, None):  # None: the link closed while the probe waited; still around its relay
        again = reprobe_after(relayed, current, probe_began_at=5.0)
        assert again == Reprobe(give_up=relayed) and again.avoid_relays == (RELAY,)


async def test_a_link_that_came_up_during_the_probe_gets_a_whole_probe_and_nothing_is_closed() -> None:
    old, new = Link(at=1.0, relay_id=RELAY), Link(at=6.0, relay_id=b"\x08" * 32)
    # Also where the probe found no link and dialed one that came up too late to answer in time.
    for unanswered in (old, new):
        again = reprobe_after(unanswered, new, probe_began_at=5.0)
        assert again == Reprobe(give_up=None) and again.avoid_relays == ()


async def test_a_silent_direct_link_or_no_link_at_all_gets_no_second_probe() -> None:
    direct = Link(at=1.0)
    assert reprobe_after(direct, direct, probe_began_at=5.0) is None
    assert reprobe_after(None, None, probe_began_at=5.0) is None


def test_a_refused_probe_is_retried_until_a_probe_timeout_has_passed() -> None:
    timeout = 2.0
    # Refused at once (0.01 s into a 2 s probe): probe again in a moment.
    assert retry_refused_in(100.0, 100.0, 100.01, timeout) == REFUSED_RETRY_INTERVAL_S
    # Still refused 1.2 s after the first: once more.
    assert retry_refused_in(100.0, 101.2, 101.21, timeout) == REFUSED_RETRY_INTERVAL_S
    # A retry would begin past the first probe's timeout: the peer is down.
    assert retry_refused_in(100.0, 101.6, 101.61, timeout) is None
    # Left unanswered (most of its timeout): no retry, however early.
    assert retry_refused_in(100.0, 100.0, 100.0 + REFUSED_WITHIN_SHARE * timeout, timeout) is None


async def test_a_peer_that_sent_on_the_probed_link_while_the_probe_waited_is_slow_not_gone() -> None:
    link = Link(at=1.0, relay_id=RELAY)
    assert not heard_during_probe(link, probe_began_at=5.0)  # never heard: not tracked, or silent
    link.last_heard_at = 4.9  # before the probe: says nothing about now
    assert not heard_during_probe(link, probe_began_at=5.0)
    link.last_heard_at = 6.0
    assert heard_during_probe(link, probe_began_at=5.0)
    link.close()  # a closed link is not the peer's voice any more
    assert not heard_during_probe(link, probe_began_at=5.0)
    assert not heard_during_probe(None, probe_began_at=5.0)


async def test_a_silent_direct_path_to_a_peer_behind_nat_is_given_up_for_its_relay() -> None:
    punched = Link(at=1.0)
    again = reprobe_after(punched, punched, probe_began_at=5.0, reachable_otherwise=True)
    assert again == Reprobe(give_up=punched) and again.avoid_relays == ()
    # A public peer's direct link has nothing to fall back on: no second probe.
    assert reprobe_after(punched, punched, probe_began_at=5.0) is None
