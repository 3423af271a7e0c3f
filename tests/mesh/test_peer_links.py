"""PeerLinks: one link kept per peer, the same one at both ends, and one dial shared by its callers."""

from __future__ import annotations

import asyncio

import pytest
from helpers.mesh_helpers import FakeLink

from meshnode.mesh.peer_links import PeerLinks, link_candidate
from meshnode.transport.base import PeerLink

A, B = b"\x01" * 32, b"\x02" * 32
WINDOW = 2.0


def both_ends(dialer: bytes, at: float, name: str) -> tuple[FakeLink, FakeLink]:
    """One connection dialed by ``dialer``, as A sees it and as B sees it."""
    at_a = FakeLink(B, dialed_here=dialer == A, at=at, name=name)
    at_b = FakeLink(A, dialed_here=dialer == B, at=at, name=name)
    return at_a, at_b


def test_both_ends_name_the_same_dialer_for_one_link():
    at_a, at_b = both_ends(A, 10.0, "a->b")
    assert link_candidate(at_a, A) == link_candidate(at_b, B)
    assert link_candidate(at_a, A).dialer_id == A


@pytest.mark.parametrize("a_sees_its_own_first", [True, False])
async def test_a_simultaneous_dial_keeps_the_lower_ids_link_at_both_ends(a_sees_its_own_first):
    by_a = both_ends(A, 10.0, "a->b")
    by_b = both_ends(B, 10.3, "b->a")
    links_a, links_b = PeerLinks(A, race_window=WINDOW), PeerLinks(B, race_window=WINDOW)
    # Each end learns of the two connections in its own order.
    first, second = (by_a, by_b) if a_sees_its_own_first else (by_b, by_a)
    links_a.add(first[0])
    links_a.add(second[0])
    links_b.add(by_b[1])
    links_b.add(by_a[1])
    assert links_a.get(B) is by_a[0] and links_b.get(A) is by_a[1]  # A's id is the lower
    assert by_b[0].is_closed and by_b[1].is_closed and not by_a[0].is_closed


async def test_a_reconnect_outside_the_race_window_replaces_the_old_link():
    links = PeerLinks(A, race_window=WINDOW)
    old = FakeLink(B, dialed_here=True, at=10.0, name="old")
    new = FakeLink(B, dialed_here=False, at=10.0 + WINDOW + 1, name="new")
    links.add(old)
    links.add(new)
    assert links.get(B) is new
    assert old.close_reason == "replaced by a newer link"
    links.remove(old)  # the replaced link's close does not forget its successor
    assert links.get(B) is new
    links.remove(new)
    assert links.get(B) is None


async def test_the_loser_of_a_tie_break_is_closed_as_a_duplicate():
    links = PeerLinks(B, race_window=WINDOW)
    kept = FakeLink(A, dialed_here=False, at=10.0)  # dialed by A, the lower id
    duplicate = FakeLink(A, dialed_here=True, at=10.5)
    links.add(kept)
    links.add(duplicate)
    assert links.get(A) is kept and duplicate.close_reason == "duplicate link"


async def test_closed_links_are_neither_got_nor_live():
    links = PeerLinks(A, race_window=WINDOW)
    link = FakeLink(B, dialed_here=True, at=1.0)
    links.add(link)
    assert links.live() == [link]
    link.close("gone")
    assert links.get(B) is None and links.live() == []
    assert links.kept(dialed := FakeLink(B, dialed_here=True, at=2.0)) is dialed


async def test_after_a_dial_the_link_kept_for_the_peer_is_used():
    links = PeerLinks(A, race_window=WINDOW)
    theirs = FakeLink(B, dialed_here=False, at=1.0)
    links.add(theirs)
    assert links.kept(FakeLink(B, dialed_here=True, at=1.1)) is theirs


async def test_concurrent_callers_share_one_dial():
    links = PeerLinks(A, race_window=WINDOW)
    dials: list[bytes] = []
    release = asyncio.Event()
    link = FakeLink(B, dialed_here=True, at=1.0)

    async def dial(peer_id: bytes) -> PeerLink:
        dials.append(peer_id)
        await release.wait()
        links.add(link)  # what the transport reports once the handshake is done
        return link

    waiters = [asyncio.create_task(links.connect(B, dial)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiters) == [link] * 3
    assert dials == [B]
    assert await links.connect(B, dial) is link and dials == [B]  # a live link needs no dial


async def test_a_failed_dial_fails_every_waiter_and_the_next_call_dials_again():
    links = PeerLinks(A, race_window=WINDOW)
    attempts = 0

    async def dial(peer_id: bytes) -> PeerLink:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0)
        raise ConnectionError("no route")

    results = await asyncio.gather(links.connect(B, dial), links.connect(B, dial), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError, ConnectionError] and attempts == 1
    with pytest.raises(ConnectionError):
        await links.connect(B, dial)
    assert attempts == 2


async def test_a_caller_that_gives_up_leaves_the_dial_to_the_others():
    links = PeerLinks(A, race_window=WINDOW)
    release = asyncio.Event()
    link = FakeLink(B, dialed_here=True, at=1.0)

    async def dial(peer_id: bytes) -> PeerLink:
        await release.wait()
        return link

    impatient = asyncio.create_task(links.connect(B, dial))
    patient = asyncio.create_task(links.connect(B, dial))
    await asyncio.sleep(0)
    impatient.cancel()
    await asyncio.sleep(0)
    release.set()
    assert await patient is link


def relayed(at: float, name: str, *, dialed_here: bool = True) -> FakeLink:
    link = FakeLink(B, dialed_here=dialed_here, at=at, name=name)
    link.relay_id = b"\x09" * 32
    return link


async def test_a_direct_link_replaces_a_relayed_one_which_drains_then_closes():
    links = PeerLinks(A, race_window=WINDOW, relayed_drain_s=0.2)
    through_relay = relayed(10.0, "relayed")
    direct = FakeLink(B, dialed_here=False, at=50.0, name="punched")
    links.add(through_relay)
    links.add(direct)
    assert links.get(B) is direct
    # Superseded at once (long streams move over), closed only after the drain.
    await asyncio.wait_for(through_relay.wait_superseded(), 1)
    assert not through_relay.is_closed
    await asyncio.sleep(0.3)
    assert through_relay.close_reason == "replaced by a direct link"
    assert not links.remove(through_relay) and links.get(B) is direct


async def test_a_working_direct_link_is_not_given_up_for_a_newer_relayed_one():
    links = PeerLinks(A, race_window=WINDOW)
    direct = FakeLink(B, dialed_here=True, at=10.0, name="lan")
    later = relayed(99.0, "relayed", dialed_here=False)
    links.add(direct)
    links.add(later)
    assert links.get(B) is direct
    assert later.close_reason == "a direct link is kept" and not direct.is_closed
    assert links.remove(direct) and links.get(B) is None
