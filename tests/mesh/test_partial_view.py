"""The partial view: a bounded active view to gossip with, a passive one to replace from."""

import random

import pytest

from meshnode.mesh.partial_view import PartialView

SELF = b"\x00" * 32
PEERS = [bytes([i]) * 32 for i in range(1, 101)]


def view(active: int = 4, passive: int = 8) -> PartialView:
    return PartialView(SELF, active_size=active, passive_size=passive, rng=random.Random(1))


def test_refresh_fills_both_views_from_the_table_within_their_sizes():
    v = view()
    v.refresh({SELF, *PEERS})
    assert len(v.active) == 4 and len(v.passive) == 8
    assert not set(v.active) & set(v.passive)
    assert SELF not in v.active + v.passive
    assert set(v.targets(3)) <= set(v.active) and len(v.targets(3)) == 3


def test_refresh_forgets_peers_that_left_the_table_and_replaces_them():
    v = view()
    v.refresh(set(PEERS))
    gone = v.active[0]
    v.refresh(set(PEERS) - {gone})
    assert gone not in v.active + v.passive
    assert len(v.active) == 4


def test_a_peer_that_links_with_a_full_view_evicts_one_into_the_passive_view():
    v = view()
    v.refresh(set(PEERS[:4]))
    evicted = v.accept(PEERS[50])
    assert evicted in PEERS[:4]
    assert PEERS[50] in v.active and len(v.active) == 4
    assert evicted in v.passive
    assert v.accept(PEERS[50]) is None  # already active: nothing changes


def test_a_failed_peer_is_forgotten_and_an_evicted_one_kept_passive():
    v = view()
    v.refresh(set(PEERS[:6]))
    failed, evicted = v.active[0], v.active[1]
    v.drop(failed, failed=True)
    v.drop(evicted, failed=False)
    assert failed not in v.active + v.passive
    assert evicted in v.passive


def test_a_shuffle_swaps_one_active_peer_for_a_passive_one():
    v = view()
    v.refresh(set(PEERS))
    before = set(v.active)
    left, joined = v.shuffle()
    assert left in before and left in v.passive
    assert joined not in before and joined in v.active
    assert len(v.active) == 4


def test_an_empty_active_view_is_refused():
    with pytest.raises(ValueError):
        PartialView(SELF, active_size=0)


def test_a_peer_synced_with_us_this_round_is_not_opened_to_again():
    v = view()
    v.refresh(set(PEERS))
    synced = v.active[:2]
    for _ in range(20):
        targets = v.targets(4, synced)
        assert sorted(targets) == sorted(set(v.active) - set(synced))
