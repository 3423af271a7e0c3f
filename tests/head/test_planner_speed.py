"""Routes by time: the planner adds each hop's announced decode time for the layers it runs."""

from meshnode.head.candidates import shard_candidate
from meshnode.head.planner import (
    HOP_OVERHEAD_MS,
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
    # Partly loaded, still faster than the idle slow one (10 + 50 * 1/4 < 30).
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


def test_a_speed_gap_smaller_than_the_load_penalty_spreads_sessions_before_the_faster_is_full():
    """The other side of the cost: a load penalty of up to FULL_LOAD_PENALTY_MS. Replicas 10 and
    30 ms apart trade speed for load: the faster takes two sessions, then the idle slower one
    is cheaper (10 + 50 * 2/4 > 30)."""
    pool = [
        candidate("a", 0, 9),
        candidate("fast", 9, 18, decode_ms_per_token=10.0, max_sessions=4),
        candidate("slow", 9, 18, decode_ms_per_token=30.0, max_sessions=4),
    ]
    ledger = SessionLedger()
    chosen = []
    for _ in range(3):
        route = plan_route_with_room(ledger.adjust(pool), GEMMA)
        ledger.hold(route.node_ids)
        chosen.append(names(route)[1])
    assert chosen == ["fast", "fast", "slow"]
