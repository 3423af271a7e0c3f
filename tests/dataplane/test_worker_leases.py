"""Session leases at the sans-IO worker: link loss, departed owners, idle timeouts, the per-peer share."""

from __future__ import annotations

from typing import Any

from engines.interface import EngineError, EngineErrorKind, SessionKey
from meshnode.dataplane.actions import FireCancel, ReleaseEngine, RunBatch
from meshnode.dataplane.lease import ReleaseReason, StreamOrigin, idle_timeout_ns, peer_session_cap
from meshnode.dataplane.worker import WorkerConfig
from meshnode.wire.pb import shard

from .harness import (
    SECOND,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    kinds,
    only_status,
    responses,
    statuses,
)

PEER_A = b"\xaa" * 32
PEER_B = b"\xbb" * 32
SELF = b"\x01" * 32


def origin(peer: bytes) -> StreamOrigin:
    return StreamOrigin(peer, local=peer == SELF)


def released(actions: list) -> list[str]:
    return sorted(a.session.session_id for a in actions if isinstance(a, ReleaseEngine))


def open_prefilled(harness: WorkerHarness, session_id: str, who: StreamOrigin, **chunk: Any) -> int:
    stream, opened = harness.open(session_id=session_id, origin=who)
    assert kinds(opened) == ["accepted"]
    out = harness.ask(stream, chunk_request(1, [1, 2, 3], session_id=session_id, **chunk))
    assert "ack" in kinds(out)
    return stream


# ---------------------------------------------------------------------------- the pure rules


def test_a_peers_cap_is_the_ceiling_of_its_share_and_never_zero_nor_more_than_all() -> None:
    assert peer_session_cap(0.75, 4) == 3
    assert peer_session_cap(0.5, 4) == 2
    assert peer_session_cap(0.7, 10) == 7  # 0.7 × 10 is 7.000000000000001 in floating point
    assert peer_session_cap(0.01, 4) == 1
    assert peer_session_cap(1.0, 4) == 4


def test_a_units_deadline_sizes_the_idle_timeout_within_the_floor_and_the_default() -> None:
    now = 1000 * SECOND
    default, floor = 120 * SECOND, 5 * SECOND
    assert idle_timeout_ns(None, now, default_ns=default, floor_ns=floor) == default
    assert idle_timeout_ns(now + 30 * SECOND, now, default_ns=default, floor_ns=floor) == 30 * SECOND
    assert idle_timeout_ns(now + SECOND, now, default_ns=default, floor_ns=floor) == floor
    assert idle_timeout_ns(now + 3600 * SECOND, now, default_ns=default, floor_ns=floor) == default


# ---------------------------------------------------------------------------- link loss


def test_a_lost_links_sessions_end_after_the_grace_and_others_stay() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=2 * SECOND))
    a1 = open_prefilled(harness, "a1", origin(PEER_A))
    a2 = open_prefilled(harness, "a2", origin(PEER_A))
    open_prefilled(harness, "b", origin(PEER_B))
    worker = harness.worker
    for stream in (a1, a2):  # the link died: every stream on it ends
        assert released(harness.run(harness.stream_closed(stream, harness.now, link_lost=True))) == []
    assert worker.get_timer() == harness.now + 2 * SECOND
    assert released(harness.run(harness.handle_timer(harness.now + 2 * SECOND - 1))) == []
    assert released(harness.run(harness.handle_timer(harness.now + 2 * SECOND))) == ["a1", "a2"]
    assert worker.load().active_sessions == 1
    assert worker.releases[ReleaseReason.LINK_CLOSED] == 2
    # Their KV is freed: the engine was told to drop exactly those two.
    assert sorted(harness.engine.released) == [SessionKey("a1", 1), SessionKey("a2", 1)]


def test_a_stream_that_merely_ended_leaves_its_session_for_the_owner_to_come_back() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=0))
    stream = open_prefilled(harness, "a", origin(PEER_A))
    assert released(harness.run(harness.stream_closed(stream, harness.now))) == []
    assert harness.worker.get_timer() == harness.now + harness.worker.config.session_idle_ttl_ns


def test_a_lost_link_with_no_grace_ends_its_sessions_at_once() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=0))
    stream = open_prefilled(harness, "a", origin(PEER_A))
    assert released(harness.run(harness.stream_closed(stream, harness.now, link_lost=True))) == ["a"]


def test_an_owner_that_reopens_within_the_grace_keeps_its_session() -> None:
    harness = WorkerHarness()
    first = open_prefilled(harness, "a", origin(PEER_A))
    worker = harness.worker
    harness.run(harness.stream_closed(first, harness.now, link_lost=True))
    again, _ = harness.open(session_id="a", origin=origin(PEER_A))  # over its new link
    out = harness.ask(again, decode_request(2, 4, 3))
    assert kinds(out)[:2] == ["chunk", "ack"] and not acks(out)[0].duplicate  # the cache is still there
    assert released(harness.run(harness.handle_timer(harness.now + 60 * SECOND))) == []
    harness.run(harness.stream_closed(again, harness.now, link_lost=True))
    assert released(harness.run(harness.handle_timer(harness.now + worker.config.owner_grace_ns))) == ["a"]


def test_a_lost_link_also_orphans_the_peers_sessions_that_no_stream_serves() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=0))
    idle = open_prefilled(harness, "idle", origin(PEER_A))
    live = open_prefilled(harness, "live", origin(PEER_A))
    harness.run(harness.stream_closed(idle, harness.now))  # ended earlier, cleanly
    open_prefilled(harness, "elsewhere", origin(PEER_A))  # on another, live link
    ended = harness.run(harness.stream_closed(live, harness.now, link_lost=True))
    assert released(ended) == ["idle", "live"]
    assert harness.worker.sessions_of(PEER_A) == 1


def test_another_peers_stream_for_the_same_session_does_not_take_it_over() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=0))
    owners = open_prefilled(harness, "a", origin(PEER_A))
    strangers, _ = harness.open(session_id="a", origin=origin(PEER_B))
    assert released(harness.run(harness.stream_closed(strangers, harness.now, link_lost=True))) == []
    assert released(harness.run(harness.stream_closed(owners, harness.now, link_lost=True))) == ["a"]


def test_a_unit_running_when_the_grace_runs_out_is_cancelled_and_its_session_ended() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=SECOND))
    stream = open_prefilled(harness, "a", origin(PEER_A))
    worker = harness.worker
    (running,) = [
        a
        for a in harness.receive_frame(stream, decode_request(2, 4, 3).SerializeToString(), harness.now)
        if isinstance(a, RunBatch)
    ]
    harness.run(harness.stream_closed(stream, harness.now, link_lost=True))
    ended = harness.run(harness.handle_timer(harness.now + SECOND))
    assert [a.unit_id for a in ended if isinstance(a, FireCancel)] == list(running.unit_ids)
    assert released(ended) == ["a"]
    assert worker.load().active_sessions == 0
    # The engine notices the cancel and its answer, coming back later, changes nothing.
    (cancelled,) = running.execute(harness.engine)
    assert isinstance(cancelled, EngineError) and cancelled.kind is EngineErrorKind.CANCELLED
    harness.run(harness.batch_finished(running.batch_id, [cancelled], harness.now))
    assert worker.load().active_sessions == 0


# ---------------------------------------------------------------------------- departed owners


def test_a_departed_owners_sessions_end_after_the_grace_and_nobody_elses() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=5 * SECOND))
    open_prefilled(harness, "a1", origin(PEER_A))
    open_prefilled(harness, "a2", origin(PEER_A))
    open_prefilled(harness, "b", origin(PEER_B))
    open_prefilled(harness, "mine", origin(SELF))
    worker = harness.worker
    assert worker.owners() == {PEER_A, PEER_B}  # this node's own sessions are nobody's to lose
    assert released(harness.run(harness.peer_departed(PEER_A, harness.now))) == []
    # Membership keeps saying so (it is polled); that does not push the end out.
    harness.run(harness.peer_departed(PEER_A, harness.now + 4 * SECOND))
    assert released(harness.run(harness.handle_timer(harness.now + 5 * SECOND))) == ["a1", "a2"]
    assert worker.releases[ReleaseReason.OWNER_DEPARTED] == 2
    assert released(harness.run(harness.peer_departed(SELF, harness.now))) == []  # local is never a peer
    assert worker.load().active_sessions == 2


def test_a_departed_owner_with_no_grace_loses_its_sessions_at_once() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=0))
    open_prefilled(harness, "a", origin(PEER_A))
    assert released(harness.run(harness.peer_departed(PEER_A, harness.now))) == ["a"]


def test_a_frame_from_an_owner_taken_for_dead_keeps_its_session() -> None:
    # A probe that failed while a relay restarted: the owner is still there and says so.
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=5 * SECOND))
    stream = open_prefilled(harness, "a", origin(PEER_A))
    worker = harness.worker
    harness.run(harness.peer_departed(PEER_A, harness.now))
    later = harness.now + 2 * SECOND
    out = responses(
        harness.run(harness.receive_frame(stream, decode_request(2, 4, 3).SerializeToString(), later))
    )
    assert "ack" in kinds(out) and not statuses(out)
    assert released(harness.run(harness.handle_timer(harness.now + 60 * SECOND))) == []
    assert worker.load().active_sessions == 1


def test_a_frame_from_another_peer_does_not_keep_a_departed_owners_session() -> None:
    harness = WorkerHarness(config=WorkerConfig(owner_grace_ns=5 * SECOND))
    open_prefilled(harness, "a", origin(PEER_A))
    strangers, _ = harness.open(session_id="a", origin=origin(PEER_B))
    harness.run(harness.peer_departed(PEER_A, harness.now))
    flow = shard.SessionRequest(flow_control=shard.FlowControl())
    harness.receive_frame(strangers, flow.SerializeToString(), harness.now + SECOND)
    assert released(harness.run(harness.handle_timer(harness.now + 5 * SECOND))) == ["a"]


# ---------------------------------------------------------------------------- idle timeouts


def test_an_idle_session_ends_when_its_units_deadline_has_passed_not_the_default() -> None:
    harness = WorkerHarness(config=WorkerConfig(session_idle_ttl_ns=120 * SECOND))
    open_prefilled(harness, "a", origin(PEER_A), deadline=harness.unix_now + 30 * SECOND)
    worker = harness.worker
    assert worker.get_timer() == harness.now + 30 * SECOND
    assert released(harness.run(harness.handle_timer(harness.now + 30 * SECOND - 1))) == []
    assert released(harness.run(harness.handle_timer(harness.now + 30 * SECOND))) == ["a"]
    assert worker.releases[ReleaseReason.IDLE] == 1


def test_every_frame_for_a_session_renews_its_lease() -> None:
    harness = WorkerHarness(config=WorkerConfig(session_idle_ttl_ns=10 * SECOND))
    stream = open_prefilled(harness, "a", origin(PEER_A))
    worker = harness.worker
    later = harness.now + 8 * SECOND
    flow = shard.SessionRequest(flow_control=shard.FlowControl())
    harness.receive_frame(stream, flow.SerializeToString(), later)
    assert released(harness.run(harness.handle_timer(harness.now + 10 * SECOND))) == []
    assert worker.get_timer() == later + 10 * SECOND


def test_a_far_deadline_cannot_hold_a_session_past_the_default() -> None:
    harness = WorkerHarness(config=WorkerConfig(session_idle_ttl_ns=10 * SECOND))
    open_prefilled(harness, "a", origin(PEER_A), deadline=harness.unix_now + 3600 * SECOND)
    assert harness.worker.get_timer() == harness.now + 10 * SECOND


# ---------------------------------------------------------------------------- the per-peer share


def share_harness() -> WorkerHarness:
    return WorkerHarness(config=WorkerConfig(max_sessions=4, peer_session_share=0.5))


def test_a_peer_over_its_share_is_refused_while_others_and_this_node_are_served() -> None:
    harness = share_harness()
    open_prefilled(harness, "a1", origin(PEER_A))
    open_prefilled(harness, "a2", origin(PEER_A))
    _, refused = harness.open(session_id="a3", origin=origin(PEER_A))
    status = only_status(refused)
    assert status.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED and status.error.retryable
    assert status.terminal
    assert harness.worker.share_refusals == 1
    assert harness.worker.sessions_of(PEER_A) == 2
    _, accepted = harness.open(session_id="b", origin=origin(PEER_B))
    assert kinds(accepted) == ["accepted"]
    _, mine = harness.open(session_id="mine", origin=origin(SELF))
    assert kinds(mine) == ["accepted"]
    assert harness.worker.load().active_sessions == 4


def test_a_peers_share_frees_up_when_its_sessions_end() -> None:
    harness = share_harness()
    open_prefilled(harness, "a1", origin(PEER_A))
    open_prefilled(harness, "a2", origin(PEER_A))
    ok, actions = harness.release("a1", 1, harness.now)
    assert ok and released(harness.run(actions)) == ["a1"]
    assert harness.worker.releases[ReleaseReason.RELEASED] == 1
    _, accepted = harness.open(session_id="a3", origin=origin(PEER_A))
    assert kinds(accepted) == ["accepted"]


def test_a_unit_that_would_readmit_a_released_session_counts_against_the_share() -> None:
    harness = share_harness()
    stream = open_prefilled(harness, "a1", origin(PEER_A))
    open_prefilled(harness, "a2", origin(PEER_A))
    open_prefilled(harness, "a3", origin(PEER_B))
    harness.run(harness.release("a1", 1, harness.now)[1])
    open_prefilled(harness, "a4", origin(PEER_A))
    # a1's stream is still open: a fresh prefill on it would re-admit the session, over the share.
    status = only_status(harness.ask(stream, chunk_request(2, [1, 2], session_id="a1")))
    assert status.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED


def test_a_newer_epoch_supersedes_the_old_sessions_state() -> None:
    harness = WorkerHarness()
    open_prefilled(harness, "a", origin(PEER_A))
    _, opened = harness.open(session_id="a", epoch=2, origin=origin(PEER_B))
    assert kinds(opened) == ["accepted"]
    assert harness.worker.releases[ReleaseReason.SUPERSEDED] == 1
    # The new epoch is PEER_B's: PEER_A leaving no longer touches it.
    assert released(harness.run(harness.peer_departed(PEER_A, harness.now))) == []
    assert harness.worker.sessions_of(PEER_B) == 1
