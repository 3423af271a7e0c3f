"""New sessions spread over the replicas of a range by load (planner and the head's own session ledger)."""

from meshnode.head.planner import ModelIdentity, ShardCandidate, plan_route, plan_route_with_room
from meshnode.head.session_load import SessionLedger

GEMMA = ModelIdentity("sha256:aa", "sha256:r1", 18)


def shard(name: str, start: int, end: int, **kwargs) -> ShardCandidate:
    return ShardCandidate(name.encode().ljust(32, b"\0"), "gemma-3-270m", GEMMA, start, end, **kwargs)


def tail(route) -> str:
    return route.hops[-1].node_id.rstrip(b"\0").decode()


def head() -> ShardCandidate:
    return shard("a", 0, 9, max_sessions=8)


def test_the_less_loaded_replica_takes_the_next_session():
    pool = [head(), shard("b1", 9, 18, active_sessions=1, max_sessions=4), shard("b2", 9, 18, max_sessions=4)]
    assert tail(plan_route(pool, GEMMA)) == "b2"
    pool = [head(), shard("b1", 9, 18, active_sessions=1, max_sessions=4)]
    pool.append(shard("b2", 9, 18, active_sessions=2, max_sessions=4))
    assert tail(plan_route(pool, GEMMA)) == "b1"


def test_load_is_the_share_of_capacity_in_use_not_the_count():
    pool = [head(), shard("small", 9, 18, active_sessions=2, max_sessions=4)]
    pool.append(shard("large", 9, 18, active_sessions=3, max_sessions=16))
    assert tail(plan_route(pool, GEMMA)) == "large"


def test_equal_load_goes_to_the_lower_node_id_whatever_the_order():
    pool = [shard("b2", 9, 18, active_sessions=1, max_sessions=4), head()]
    pool.append(shard("b1", 9, 18, active_sessions=2, max_sessions=8))
    assert tail(plan_route(pool, GEMMA)) == tail(plan_route(list(reversed(pool)), GEMMA)) == "b1"


def test_a_full_replica_is_left_out_while_another_has_room():
    # Closer but full: the far one with room wins, though the cost model alone would pick the full one.
    full = shard("near", 9, 18, active_sessions=4, max_sessions=4)
    roomy = shard("far", 9, 18, rtt_ms=80, active_sessions=1, max_sessions=4)
    assert tail(plan_route([head(), full, roomy], GEMMA)) == "near"
    assert tail(plan_route_with_room([head(), full, roomy], GEMMA)) == "far"
    assert full.full and not roomy.full and not shard("x", 0, 1).full


def test_with_every_replica_full_the_route_is_still_planned_for_the_shards_to_decide():
    pool = [head(), shard("b1", 9, 18, active_sessions=4, max_sessions=4)]
    pool.append(shard("b2", 9, 18, active_sessions=5, max_sessions=4))
    assert tail(plan_route_with_room(pool, GEMMA)) == "b1"


def test_the_heads_own_sessions_count_before_gossip_reports_them():
    ledger = SessionLedger()
    b1, b2 = shard("b1", 9, 18, max_sessions=4), shard("b2", 9, 18, max_sessions=4)
    picks = []
    for _ in range(4):
        route = plan_route_with_room(ledger.adjust([head(), b1, b2]), GEMMA)
        ledger.hold(route.node_ids)
        picks.append(tail(route))
    assert picks == ["b1", "b2", "b1", "b2"]
    ledger.release([b1.node_id, b1.node_id])
    assert (ledger.held(b1.node_id), ledger.held(b2.node_id)) == (0, 2)
    assert tail(plan_route_with_room(ledger.adjust([head(), b1, b2]), GEMMA)) == "b1"


def test_gossip_that_already_counts_the_heads_sessions_is_not_added_to():
    ledger = SessionLedger()
    b1 = shard("b1", 9, 18, active_sessions=3, max_sessions=4)
    ledger.hold([b1.node_id])
    assert ledger.adjust([b1])[0].active_sessions == 3
    ledger.hold([b1.node_id] * 3)
    assert ledger.adjust([b1])[0].active_sessions == 4
