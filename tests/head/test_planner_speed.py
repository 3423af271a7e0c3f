"""Routes by time: the planner adds each hop's announced decode time for the layers it runs."""

import pytest

from meshnode.head.candidates import shard_candidate
from meshnode.head.planner import (
    FULL_LOAD_PENALTY_MS,
    FULL_LOAD_SHARE_OF_COMPUTE,
    HOP_OVERHEAD_MS,
    MIN_FULL_LOAD_PENALTY_MS,
    ModelIdentity,
    ShardCandidate,
    plan_route,
    plan_route_with_room,
)
from meshnode.head.session_load import SessionLedger
from meshnode.wire.pb import mesh, shard

GEMMA = ModelIdentity("sha256:aa", "sha256:r1", 18)


def candidate(name: str, start: int, end: int, **kwargs) -> ShardCandidate:
    return ShardCandidate(name.encode().ljust(32, b"\0"), "gemma-3-270m", GEMMA, start, end, **kwargs)


def names(route) -> list[str]:
    return [hop.node_id.rstrip(b"\0").decode() for hop in route.hops]


def test_without_an_announcement_a_hop_costs_what_it_did():
    plain = candidate("a", 0, 18, rtt_ms=3.0, active_sessions=1, max_sessions=4)
    assert plain.compute_ms(18) == 0.0
    assert plain.cost_ms == HOP_OVERHEAD_MS + 3.0 + 50.0 * 0.25
    assert plain.cost_from_ms(9) == plain.cost_ms


def test_the_compute_term_scales_with_the_layers_a_route_asks_of_the_hop():
    timed = candidate("a", 0, 10, decode_ms_per_token=20.0)
    assert timed.cost_ms == HOP_OVERHEAD_MS + 20.0
    # Entered at layer 6 (an earlier hop ran 0..6), it runs 4 of its 10 layers.
    assert timed.cost_from_ms(6) == HOP_OVERHEAD_MS + 8.0
    route = plan_route([candidate("head", 0, 6), timed, candidate("tail", 10, 18)], GEMMA)
    assert names(route) == ["head", "a", "tail"]


def test_of_two_replicas_the_faster_wins_until_it_is_full_then_the_slower_takes_the_spill():
    def pool(fast_active: int) -> list[ShardCandidate]:
        return [
            candidate("a", 0, 9),
            # Named so that a tie would go to "slow": only the speed makes "fast" win.
            candidate("fast", 9, 18, decode_ms_per_token=10.0, active_sessions=fast_active, max_sessions=4),
            candidate("slow", 9, 18, decode_ms_per_token=30.0, max_sessions=4),
        ]

    assert names(plan_route(pool(0), GEMMA)) == ["a", "fast"]
    # Partly loaded, still faster than the idle slow one (10 + 2 * 1/4 < 30).
    assert names(plan_route_with_room(pool(1), GEMMA)) == ["a", "fast"]
    # Full: the slower replica takes the next session.
    assert names(plan_route_with_room(pool(4), GEMMA)) == ["a", "slow"]


def test_a_faster_chain_of_two_hops_beats_a_slow_single_hop():
    solo = candidate("solo", 0, 18, decode_ms_per_token=90.0)
    pair = [candidate("x", 0, 9, decode_ms_per_token=20.0), candidate("y", 9, 18, decode_ms_per_token=20.0)]
    assert names(plan_route([solo, *pair], GEMMA)) == ["x", "y"]
    # Without speeds, fewer hops win as before.
    plain = [candidate("solo", 0, 18), candidate("x", 0, 9), candidate("y", 9, 18)]
    assert names(plan_route(plain, GEMMA)) == ["solo"]


def test_a_candidate_reads_the_announced_speed_and_none_when_unsaid():
    served = mesh.ServedShard(
        model_name="gemma-3-270m",
        fingerprint=shard.Fingerprint(model_artifact_digest="sha256:aa", runtime_recipe_digest="sha256:r1"),
        shard_range=shard.ShardRange(start_layer=0, end_layer=18),
        total_layers=18,
    )
    node_id = b"n".ljust(32, b"\0")
    unsaid = shard_candidate(node_id, mesh.PeerAnnouncement(endpoint_id=node_id, serving=served))
    assert unsaid is not None and unsaid.decode_ms_per_token == 0.0
    served.speed.CopyFrom(
        mesh.StageSpeed(
            decode_us_per_token=12_500, prefill_us_per_token=900, source=mesh.STAGE_SPEED_SOURCE_MEASURED
        )
    )
    said = shard_candidate(node_id, mesh.PeerAnnouncement(endpoint_id=node_id, serving=served))
    assert said is not None and said.decode_ms_per_token == 12.5


def test_sessions_arriving_one_by_one_fill_the_three_times_faster_replica_then_spill_to_the_slower():
    """What a head does as requests come: each route planned over gossip adjusted by the
    sessions this head holds (SessionLedger), then held. A replica three times faster (30 ms
    against 90 ms for the range) takes every session until it is full; the rest go to the slower."""
    fast = candidate("fast", 9, 18, decode_ms_per_token=30.0, max_sessions=4)
    slow = candidate("slow", 9, 18, decode_ms_per_token=90.0, max_sessions=4)
    pool = [candidate("a", 0, 9), fast, slow]
    ledger = SessionLedger()
    chosen = []
    for _ in range(7):
        route = plan_route_with_room(ledger.adjust(pool), GEMMA)
        ledger.hold(route.node_ids)
        chosen.append(names(route)[1])
    assert chosen == ["fast"] * 4 + ["slow"] * 3
    # A session ends on the faster one: the next goes there again.
    ledger.release([fast.node_id])
    assert names(plan_route_with_room(ledger.adjust(pool), GEMMA)) == ["a", "fast"]


def test_a_full_hop_that_announces_its_speed_costs_a_share_of_its_compute_more():
    full = {"active_sessions": 4, "max_sessions": 4}
    slow = candidate("slow", 0, 10, decode_ms_per_token=40.0, **full)
    assert slow.cost_ms == pytest.approx(HOP_OVERHEAD_MS + 40.0 * (1 + FULL_LOAD_SHARE_OF_COMPUTE))
    # Entered at layer 6 it runs 4 of its 10 layers: the penalty is a share of those (16 ms), half full.
    half = candidate("half", 0, 10, decode_ms_per_token=40.0, active_sessions=2, max_sessions=4)
    assert half.cost_from_ms(6) == pytest.approx(
        HOP_OVERHEAD_MS + 16.0 + 0.5 * FULL_LOAD_SHARE_OF_COMPUTE * 16.0
    )
    # A short compute still pays the floor; without an announcement, the fixed penalty.
    quick = candidate("quick", 0, 10, decode_ms_per_token=1.0, **full)
    assert quick.cost_ms == pytest.approx(HOP_OVERHEAD_MS + 1.0 + MIN_FULL_LOAD_PENALTY_MS)
    assert candidate("plain", 0, 10, **full).cost_ms == HOP_OVERHEAD_MS + FULL_LOAD_PENALTY_MS


def picks_as_sessions_arrive(pool: list[ShardCandidate], sessions: int) -> list[str]:
    """The replica each new session's route ends on, as a head holds them one by one."""
    ledger = SessionLedger()
    chosen = []
    for _ in range(sessions):
        route = plan_route_with_room(ledger.adjust(pool), GEMMA)
        ledger.hold(route.node_ids)
        chosen.append(names(route)[-1])
    return chosen


@pytest.mark.parametrize(("fast_ms", "slow_ms"), [(3.0, 9.0), (10.0, 30.0)])
def test_the_faster_replica_takes_every_session_until_full_then_spills_whatever_the_gap(
    fast_ms: float, slow_ms: float
):
    """Issue 55's acceptance for a gap far below the 50 ms fixed penalty too: 3 ms against 9 ms
    per token, as two CPU replicas of one range may be. With that fixed penalty the head sent the
    third session to the slower replica while the faster one had room."""
    pool = [
        candidate("a", 0, 9),
        # Named so that a tie would go to "slow".
        candidate("fast", 9, 18, decode_ms_per_token=fast_ms, max_sessions=4),
        candidate("slow", 9, 18, decode_ms_per_token=slow_ms, max_sessions=4),
    ]
    assert picks_as_sessions_arrive(pool, 7) == ["fast"] * 4 + ["slow"] * 3


def test_equal_replicas_that_announce_their_speed_still_spread_by_load():
    b1 = candidate("b1", 9, 18, decode_ms_per_token=9.0, max_sessions=4)
    b2 = candidate("b2", 9, 18, decode_ms_per_token=9.0, max_sessions=4)
    assert picks_as_sessions_arrive([candidate("a", 0, 9), b1, b2], 4) == ["b1", "b2", "b1", "b2"]
    # Round trips a fraction of a ms apart do not pile the sessions onto the closer one, however
    # short the compute (the penalty's floor).
    b1 = candidate("b1", 9, 18, decode_ms_per_token=1.0, max_sessions=4, rtt_ms=0.6)
    b2 = candidate("b2", 9, 18, decode_ms_per_token=1.0, max_sessions=4, rtt_ms=0.3)
    assert picks_as_sessions_arrive([candidate("a", 0, 9), b1, b2], 4) == ["b2", "b1", "b2", "b1"]


def test_a_replica_only_a_little_faster_shares_the_sessions_before_it_is_full():
    """Within the margin the mesh counts nodes alike by (15 % here), load decides before speed does."""
    pool = [
        candidate("a", 0, 9),
        candidate("fast", 9, 18, decode_ms_per_token=10.0, max_sessions=4),
        candidate("slow", 9, 18, decode_ms_per_token=11.5, max_sessions=4),
    ]
    assert picks_as_sessions_arrive(pool, 4) == ["fast", "fast", "fast", "slow"]
