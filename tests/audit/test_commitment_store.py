"""The head's commitment store stays bounded: per generation, in total, and in time."""

from __future__ import annotations

import pytest

from meshnode.audit.commitment_store import CommitmentStore
from meshnode.wire.pb import shard


def batch(count: int, tag: bytes = b"c") -> list[shard.SignedCommitment]:
    return [shard.SignedCommitment(commitment=tag + bytes([i]), signature=b"s") for i in range(count)]


def test_a_generation_keeps_its_first_commitments_up_to_its_cap_and_says_it_lost_some():
    store = CommitmentStore(max_per_session=4, max_total=16)
    store.add("g", batch(3), now_ns=0)
    store.add("g", batch(3, b"d"), now_ns=1)
    kept = store.session("g", now_ns=2)
    assert kept is not None and kept.truncated
    assert [c.commitment for c in kept.commitments] == [b"c\0", b"c\1", b"c\2", b"d\0"]
    assert len(store) == 4


def test_the_total_cap_evicts_the_generations_least_recently_added_to():
    store = CommitmentStore(max_per_session=4, max_total=8)
    store.add("old", batch(4), now_ns=0)
    store.add("middle", batch(2), now_ns=1)
    store.add("old", batch(0), now_ns=2)  # an addition, even empty, makes it recent
    store.add("new", batch(4), now_ns=3)
    assert store.session_ids() == ["old", "new"]
    assert len(store) == 8
    assert store.session("middle", now_ns=4) is None


def test_nothing_outlives_the_window_after_its_last_addition():
    store = CommitmentStore(window_ns=100, max_per_session=4, max_total=8)
    store.add("a", batch(2), now_ns=0)
    store.add("b", batch(2), now_ns=60)
    assert store.session("a", now_ns=99) is not None
    assert store.session("a", now_ns=100) is None
    assert store.session_ids() == ["b"] and len(store) == 2
    store.expire(160)
    assert store.session_ids() == [] and len(store) == 0


def test_a_store_without_room_for_one_generation_is_refused():
    with pytest.raises(ValueError):
        CommitmentStore(max_per_session=8, max_total=4)
