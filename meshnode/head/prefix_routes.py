"""Whether a route holding a prefix of the prompt beats the cheapest route. Pure.

A route whose hops kept a prefix of the prompt saves prefilling it, at every hop; the cheapest
route by the planner (:mod:`meshnode.head.planner`) may have idler or closer hops. As vLLM's
production router and SGLang's cache-aware router do, the cached route wins unless it is no
longer usable (a hop gone, excluded, not accepting, its range changed, or full) or it is much
busier than the cheapest: a hop's load (its share of sessions in use) more than
``MAX_EXTRA_LOAD`` above the cheapest route's busiest hop. Among usable cached routes the one
holding the longest prefix wins (``PrefixIndex.holders`` gives them longest first).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshnode.head.planner import Route, ShardCandidate

# How much busier (in share of sessions in use) a cached route's busiest hop may be than the
# cheapest route's before the cached prefix is not worth the wait behind the other sessions.
MAX_EXTRA_LOAD = 0.5


def preferred_route(
    cheapest: Route,
    holders: Sequence[tuple[Route, int]],
    candidates: Iterable[ShardCandidate],
    exclude: frozenset[bytes],
) -> tuple[Route, int] | None:
    """The cached route to take instead of ``cheapest`` and the prefix length it holds; None: take
    ``cheapest`` (which may itself be the route holding the prefix)."""
    if not holders:
        return None
    shards = {(c.node_id, c.start_layer, c.end_layer): c for c in candidates}
    busiest = _busiest(cheapest, shards)
    for route, length in holders:
        if route.hops == cheapest.hops:
            return None
        if _usable(route, shards, exclude) and _busiest(route, shards) <= busiest + MAX_EXTRA_LOAD:
            return route, length
    return None


_Shards = dict[tuple[bytes, int, int], ShardCandidate]


def _usable(route: Route, shards: _Shards, exclude: frozenset[bytes]) -> bool:
    for hop in route.hops:
        candidate = shards.get((hop.node_id, hop.start_layer, hop.end_layer))
        if (
            candidate is None
            or hop.node_id in exclude
            or not candidate.accepting
            or candidate.full
            or candidate.model != route.model
        ):
            return False
    return True


def _busiest(route: Route, shards: _Shards) -> float:
    loads = [
        shard.load
        for hop in route.hops
        if (shard := shards.get((hop.node_id, hop.start_layer, hop.end_layer))) is not None
    ]
    return max(loads, default=0.0)


__all__ = ["MAX_EXTRA_LOAD", "preferred_route"]
