"""The session table alone (pure): epochs that cannot come back, leases sized by deadlines, and
orphans that end after their grace unless the owner shows up."""

from __future__ import annotations

from meshnode.dataplane.lease import ReleaseReason, StreamOrigin
from meshnode.dataplane.payload import HopRole
from meshnode.dataplane.route import make_route, validate_route
from meshnode.dataplane.session_table import LeaseRules, SessionTable
from meshnode.dataplane.worker_state import StreamState
from meshnode.wire.pb import shard

S = 1_000_000_000
RULES = LeaseRules(idle_ttl_ns=120 * S, idle_floor_ns=5 * S, owner_grace_ns=5 * S, replay_window=4)
PEER = StreamOrigin(b"peer", local=False)
ROLE = HopRole(
    takes_tokens=True, is_tail=True, hidden_size=8, vocab_size=16, boundary_dtype=shard.DTYPE_FLOAT32
)
PLAN = validate_route(make_route(), end_layer=4, is_tail=True)


def opened(table: SessionTable, session_id: str = "s", *, origin: StreamOrigin = PEER, stream_id: int = 1):
    stream = StreamState(stream_id, origin, session_id=session_id, plan=PLAN)
    return stream, table.create(stream, 3, ROLE, now_ns=0)


def test_a_removed_session_leaves_its_epoch_as_the_floor_and_is_counted_by_reason():
    table = SessionTable(RULES)
    _, session = opened(table)
    assert table.epoch_floor("s") == 3 and table.sessions_of(b"peer") == 1 and table.owners() == {b"peer"}
    table.remove(session, ReleaseReason.RELEASED)
    assert table.get("s") is None and not table.holds(session)
    assert table.epoch_floor("s") == 3 and table.releases[ReleaseReason.RELEASED] == 1


def test_an_idle_session_ends_at_its_lease_unless_busy_and_a_deadline_shortens_the_lease():
    table = SessionTable(RULES)
    stream, session = opened(table)
    assert table.next_due(set()) == 120 * S
    assert table.due(120 * S, {session}) == []
    assert table.due(120 * S, set()) == [(session, ReleaseReason.IDLE, False)]
    table.touch_for_unit(session, stream, 10 * S, deadline_at_ns=12 * S)
    # Two seconds to the deadline, but never below the five-second floor.
    assert table.next_due(set()) == 15 * S


def test_an_orphan_ends_after_the_grace_unless_its_owner_shows_up_and_more_signs_do_not_extend_it():
    table = SessionTable(RULES)
    _, session = opened(table)
    table.orphan(session, 1 * S, ReleaseReason.LINK_CLOSED)
    table.orphan(session, 4 * S, ReleaseReason.OWNER_DEPARTED)
    assert table.due(6 * S, {session}) == [(session, ReleaseReason.LINK_CLOSED, True)]
    other = StreamState(2, StreamOrigin(b"other", local=False), session_id="s")
    table.touch(session, other, 2 * S)
    assert session.orphaned_until_ns == 6 * S
    table.touch(session, StreamState(7, PEER, session_id="s"), 2 * S)
    assert session.orphaned_until_ns is None and session.owner_stream == 7
