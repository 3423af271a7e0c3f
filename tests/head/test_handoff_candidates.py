"""Under a mesh policy that requires handoffs a head routes only through hops that announce they
sign them (ServedShard.states_handoffs; meshnode.head.candidates.stating_handoffs)."""

import pytest

from meshnode.head.candidates import shard_candidate, stating_handoffs
from meshnode.head.planner import ModelIdentity, NoRouteError, plan_route
from meshnode.wire.pb import mesh, shard

MODEL = ModelIdentity("sha256:aa", "sha256:r1", 4)


def announced(name: str, start: int, end: int, *, states_handoffs: bool):
    served = mesh.ServedShard(
        model_name="m",
        fingerprint=shard.Fingerprint(model_artifact_digest="sha256:aa", runtime_recipe_digest="sha256:r1"),
        shard_range=shard.ShardRange(start_layer=start, end_layer=end),
        total_layers=4,
        states_handoffs=states_handoffs,
    )
    node_id = name.encode().ljust(32, b"\0")
    candidate = shard_candidate(node_id, mesh.PeerAnnouncement(endpoint_id=node_id, serving=served))
    assert candidate is not None
    return candidate


def names(route) -> list[str]:
    return [hop.node_id.rstrip(b"\0").decode() for hop in route.hops]


def test_only_hops_that_announce_handoffs_are_routed_through_and_an_older_node_is_left_out():
    older = announced("old", 0, 2, states_handoffs=False)
    newer = announced("new", 0, 2, states_handoffs=True)
    tail = announced("tail", 2, 4, states_handoffs=True)
    assert not older.states_handoffs and newer.states_handoffs
    pool = [older, newer, tail]
    assert stating_handoffs(pool) == [newer, tail]
    assert names(plan_route(stating_handoffs(pool), MODEL)) == ["new", "tail"]


def test_no_route_when_only_an_older_node_serves_a_range():
    pool = [announced("old", 0, 2, states_handoffs=False), announced("tail", 2, 4, states_handoffs=True)]
    with pytest.raises(NoRouteError):
        plan_route(stating_handoffs(pool), MODEL)
