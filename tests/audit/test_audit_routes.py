"""Where an audit recomputes: a route's hops moved to replicas of exactly their ranges (pure)."""

from __future__ import annotations

from meshnode.head.audit_routes import decider_route, replay_route
from meshnode.head.planner import Hop, ModelIdentity, Route, ShardCandidate

MODEL = ModelIdentity("artifact", "recipe", 4)
OTHER_MODEL = ModelIdentity("other", "recipe", 4)


def node(i: int) -> bytes:
    return bytes([i]) * 32


def candidate(
    i: int, start: int, end: int, model: ModelIdentity = MODEL, *, accepting: bool = True
) -> ShardCandidate:
    return ShardCandidate(node(i), "m", model, start, end, accepting=accepting, numerics=f"n{i}")


ROUTE = Route(MODEL, "m", (Hop(node(1), 0, 2, 0), Hop(node(2), 2, 3, 2), Hop(node(3), 3, 4, 3)))


def first(choices):
    return choices[0]


def test_each_hop_with_a_replica_moves_to_one_the_others_stay_and_the_route_ends_at_the_last_moved():
    candidates = [
        candidate(1, 0, 2),
        candidate(2, 2, 3),
        candidate(4, 2, 3),
        candidate(5, 2, 4),  # another range: not a replica of [2, 3)
        candidate(6, 3, 4, OTHER_MODEL),  # another model
        candidate(7, 3, 4, accepting=False),  # refusing sessions
        candidate(3, 3, 4),
    ]
    replay = replay_route(ROUTE, candidates, frozenset(), first)
    assert replay is not None
    # The tail has no replica: it would only compute again what it computed.
    assert replay.node_ids == (node(1), node(4))
    assert replay.hops[1].numerics == "n4" and replay.hops[1].effective_start_layer == 2
    with_tail = replay_route(ROUTE, [*candidates, candidate(8, 3, 4)], frozenset(), first)
    assert with_tail is not None and with_tail.node_ids == (node(1), node(4), node(8))


def test_no_replica_anywhere_means_no_audit_and_excluded_nodes_are_no_replicas():
    assert replay_route(ROUTE, [candidate(1, 0, 2), candidate(2, 2, 3)], frozenset(), first) is None
    assert replay_route(ROUTE, [candidate(4, 2, 3)], frozenset({node(4)}), first) is None


def test_a_decider_runs_the_route_up_to_the_disputed_hop_on_yet_another_replica():
    replay = Route(MODEL, "m", (Hop(node(1), 0, 2, 0), Hop(node(4), 2, 3, 2), Hop(node(3), 3, 4, 3)))
    candidates = [candidate(2, 2, 3), candidate(4, 2, 3), candidate(5, 2, 3)]
    decider = decider_route(replay, 1, candidates, frozenset({node(2), node(4)}), first)
    assert decider is not None and decider.node_ids == (node(1), node(5))
    assert decider_route(replay, 1, candidates, frozenset({node(2), node(5)}), first) is None
