"""The session table's prefix cache, pure bookkeeping: what a release keeps, when it is kept once
only, which slot a new session takes, and how a session opens from a kept prefix (adopting its
slot or copying it)."""

from __future__ import annotations

from engines.interface import SessionKey
from engines.session_table import Session, SessionTable

D0, D1, D2 = b"d0", b"d1", b"d2"
OTHER = b"xx"


def _table(capacity: int = 3, entries: int = 4, prefix_ttl_s: float = 100.0) -> SessionTable:
    return SessionTable(capacity, ttl_s=1000.0, prefix_entries=entries, prefix_ttl_s=prefix_ttl_s)


def _session(
    table: SessionTable, name: str, blocks: list[tuple[int, bytes]], past_len: int, now: float = 0.0
) -> Session:
    """A live session that prefilled ``blocks`` (from 0) and then reached ``past_len``."""
    session, _ = table.open(SessionKey(name, 1), 0, now)
    first = 0
    for end, digest in blocks:
        session.record_block(first, end, digest)
        first = end
    session.past_len = session.committed_len = past_len
    return session


def _kept(table: SessionTable, name: str, blocks: list[tuple[int, bytes]], now: float = 0.0) -> Session:
    _session(table, name, blocks, blocks[-1][0] + 5, now)
    kept, _ = table.release(SessionKey(name, 1), now)
    assert kept is not None and kept.kept
    return kept


def test_a_release_keeps_the_session_cut_to_its_last_block() -> None:
    table = _table()
    session = _session(table, "a", [(32, D0), (64, D1)], past_len=80)
    kept, evicted = table.release(SessionKey("a", 1), 1.0)
    assert kept is session and kept.kept and evicted == []
    assert kept.past_len == kept.committed_len == 64 and kept.blocks_end == 64
    assert table.kept() == [kept] and table.lookup(SessionKey("a", 1)) is None


def test_a_block_only_extends_an_unbroken_run_from_zero() -> None:
    session = Session(SessionKey("a", 1), 0, 0)
    session.record_block(32, 64, D1)  # no block before it: not a block of this session
    assert session.blocks == []
    session.record_block(0, 32, D0)
    session.record_block(40, 64, D1)  # a gap
    session.record_block(32, 64, b"")  # no digest: a chunk that completes no block
    assert session.blocks == [(32, D0)]


def test_a_release_without_blocks_or_with_the_cache_off_frees_the_slot() -> None:
    for table, blocks in ((_table(), []), (_table(entries=0), [(32, D0)])):
        session = _session(table, "a", blocks, past_len=40)
        kept, evicted = table.release(SessionKey("a", 1), 1.0)
        assert kept is session and not kept.kept and evicted == []
        assert table.kept() == []
        # The slot is free again: a new session takes it.
        assert table.open(SessionKey("b", 1), 0, 2.0)[0].slot == session.slot


def test_a_rolled_back_session_keeps_only_the_blocks_it_still_holds() -> None:
    table = _table()
    session = _session(table, "a", [(32, D0), (64, D1)], past_len=64)
    session.past_len = session.committed_len = 50
    kept, _ = table.release(SessionKey("a", 1), 1.0)
    assert kept is not None and kept.blocks == [(32, D0)] and kept.past_len == 32


def test_blocks_another_kept_prefix_holds_are_not_kept_twice() -> None:
    table = _table()
    longer = _kept(table, "long", [(32, D0), (64, D1), (96, D2)], now=1.0)
    _session(table, "short", [(32, D0), (64, D1)], past_len=70)
    dropped, evicted = table.release(SessionKey("short", 1), 5.0)
    assert dropped is not None and not dropped.kept and evicted == []
    assert table.kept() == [longer] and longer.last_used == 5.0
    assert table.open(SessionKey("next", 1), 0, 6.0)[0].slot == dropped.slot


def test_a_kept_prefix_the_released_session_extends_is_replaced() -> None:
    table = _table()
    shorter = _kept(table, "short", [(32, D0)])
    _session(table, "long", [(32, D0), (64, D1)], past_len=64)
    kept, evicted = table.release(SessionKey("long", 1), 2.0)
    assert evicted == [shorter]
    assert kept is not None and table.kept() == [kept]


def test_prefixes_computed_from_other_start_layers_are_kept_apart() -> None:
    table = _table()
    _kept(table, "a", [(32, D0)])
    session, _ = table.open(SessionKey("b", 1), 3, 0.0)
    session.record_block(0, 32, D0)
    session.past_len = 32
    kept, evicted = table.release(SessionKey("b", 1), 1.0)
    assert kept is not None and kept.kept and evicted == []
    assert len(table.kept()) == 2
    assert table.open_from_prefix(SessionKey("c", 1), 5, 32, D0, 2.0) is None


def test_kept_prefixes_beyond_the_limit_go_least_recently_used_first() -> None:
    table = _table(capacity=4, entries=2)
    first = _kept(table, "a", [(32, D0)], now=1.0)
    second = _kept(table, "b", [(32, D1)], now=2.0)
    third = _session(table, "c", [(32, D2)], past_len=40)
    kept, evicted = table.release(SessionKey("c", 1), 3.0)
    assert kept is third and evicted == [first]
    assert table.kept() == [second, third]


def test_a_new_session_takes_a_free_slot_then_a_kept_prefix_never_a_live_session() -> None:
    table = _table(capacity=3)
    kept = _kept(table, "kept", [(32, D0)])
    live = _session(table, "live", [], past_len=10)
    free, displaced = table.open(SessionKey("new-1", 1), 0, 1.0)
    assert displaced == [] and free.slot not in (kept.slot, live.slot)
    taken, displaced = table.open(SessionKey("new-2", 1), 0, 2.0)
    assert displaced == [kept] and taken.slot == kept.slot
    assert table.kept() == [] and table.lookup(SessionKey("live", 1)) is live


def test_a_session_adopts_a_kept_prefix_that_holds_exactly_its_start() -> None:
    table = _table()
    kept = _kept(table, "a", [(32, D0), (64, D1)])
    start = table.open_from_prefix(SessionKey("b", 1), 0, 64, D1, 3.0)
    assert start is not None and start.source is kept and not start.copied and start.evicted == []
    session = start.session
    assert session.slot == kept.slot and session.past_len == session.committed_len == 64
    assert session.blocks == [(32, D0), (64, D1)] and not session.kept
    assert table.kept() == [] and table.lookup(SessionKey("b", 1)) is session


def test_a_session_copies_a_longer_kept_prefix_into_a_free_slot() -> None:
    table = _table()
    kept = _kept(table, "a", [(32, D0), (64, D1), (96, D2)])
    start = table.open_from_prefix(SessionKey("b", 1), 0, 64, D1, 3.0)
    assert start is not None and start.copied and start.source is kept and start.evicted == []
    assert start.session.slot != kept.slot and start.session.blocks == [(32, D0), (64, D1)]
    assert start.session.past_len == 64
    # The longer prefix stays whole, and serves the next session.
    assert table.kept() == [kept] and kept.blocks_end == 96 and kept.last_used == 3.0
    assert table.open_from_prefix(SessionKey("c", 1), 0, 96, D2, 4.0) is not None


def test_with_no_slot_to_spare_a_session_adopts_the_longer_prefix_instead() -> None:
    table = _table(capacity=2)
    kept = _kept(table, "a", [(32, D0), (64, D1)])
    _session(table, "live", [], past_len=10)
    start = table.open_from_prefix(SessionKey("b", 1), 0, 32, D0, 3.0)
    assert start is not None and not start.copied and start.evicted == []
    assert start.session.slot == kept.slot and start.session.blocks == [(32, D0)]
    assert table.kept() == [] and table.lookup(SessionKey("live", 1)) is not None


def test_a_copy_may_push_out_another_kept_prefix_but_not_a_live_session() -> None:
    table = _table(capacity=3)
    other = _kept(table, "other", [(32, D2)], now=0.0)
    source = _kept(table, "a", [(32, D0), (64, D1)], now=1.0)
    _session(table, "live", [], past_len=10)
    start = table.open_from_prefix(SessionKey("b", 1), 0, 32, D0, 3.0)
    assert start is not None and start.copied and start.evicted == [other]
    assert start.session.slot == other.slot and table.kept() == [source]


def test_an_unknown_prefix_opens_nothing() -> None:
    table = _table()
    kept = _kept(table, "a", [(32, D0), (64, D1)])
    for length, digest in ((64, OTHER), (48, D1), (96, D1), (32, D1)):
        assert table.open_from_prefix(SessionKey("b", 1), 0, length, digest, 1.0) is None
    assert table.kept() == [kept] and table.lookup(SessionKey("b", 1)) is None


def test_kept_prefixes_expire_unused_and_a_use_renews_them() -> None:
    table = _table(prefix_ttl_s=100.0)
    old = _kept(table, "old", [(32, D0)], now=0.0)
    renewed = _kept(table, "renewed", [(32, D1), (64, D2)], now=0.0)
    # Copying from it counts as a use.
    start = table.open_from_prefix(SessionKey("b", 1), 0, 32, D1, 60.0)
    assert start is not None and start.copied
    table.remove(SessionKey("b", 1))
    expired = table.expire(150.0)
    assert expired == [old] and table.kept() == [renewed]
    assert table.expire(161.0) == [renewed] and table.kept() == []


def test_dropping_a_start_layer_drops_its_kept_prefixes() -> None:
    table = _table()
    kept = _kept(table, "a", [(32, D0)])
    assert table.remove_where_start(0) == [kept] and table.kept() == []
