"""Where an audit recomputes: other replicas of a route's ranges. Pure.

A replay runs the generation's units on the route with every hop that has a replica (another
node serving the same registered range of the same model, not excluded) moved to one; the
hops without one stay, and the route ends at the last hop moved: the hops after it would only
compute again what they computed, on the same node, for nothing an audit can convict on (the
tail, with its vocabulary, is often the dearest). A decider (a third computation of one disputed hop) runs the route up
to that hop only, the hop on yet another replica. ``pick`` chooses among replicas (a seeded
random choice in the auditor, so which replica checks which is not predictable by a hop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from meshnode.head.planner import Hop, Route, ShardCandidate

Pick = Callable[[Sequence[ShardCandidate]], ShardCandidate]


def replicas(
    hop: Hop, route: Route, candidates: Iterable[ShardCandidate], exclude: frozenset[bytes]
) -> list[ShardCandidate]:
    """The other nodes serving exactly ``hop``'s registered range of ``route``'s model, by id."""
    found = [
        c
        for c in candidates
        if c.model == route.model
        and (c.start_layer, c.end_layer) == (hop.start_layer, hop.end_layer)
        and c.node_id != hop.node_id
        and c.node_id not in exclude
        and c.accepting
    ]
    return sorted(found, key=lambda c: c.node_id)


def _moved(hop: Hop, to: ShardCandidate) -> Hop:
    return replace(
        hop,
        node_id=to.node_id,
        numerics=to.numerics,
        verifies_drafts=to.verifies_drafts,
        keeps_partial_blocks=to.keeps_partial_blocks,
    )


def replay_route(
    route: Route, candidates: Sequence[ShardCandidate], exclude: frozenset[bytes], pick: Pick
) -> Route | None:
    """``route`` with each hop that has a replica on one, up to the last such hop; None when no
    hop has any."""
    hops: list[Hop] = []
    last_moved = -1
    for index, hop in enumerate(route.hops):
        others = replicas(hop, route, candidates, exclude)
        if others:
            hops.append(_moved(hop, pick(others)))
            last_moved = index
        else:
            hops.append(hop)
    return replace(route, hops=tuple(hops[: last_moved + 1])) if last_moved >= 0 else None


def decider_route(
    route: Route, hop_index: int, candidates: Sequence[ShardCandidate], exclude: frozenset[bytes], pick: Pick
) -> Route | None:
    """``route`` up to hop ``hop_index``, that hop on a replica not in ``exclude``; None: none left."""
    hop = route.hops[hop_index]
    others = replicas(hop, route, candidates, exclude | {hop.node_id})
    if not others:
        return None
    return replace(route, hops=(*route.hops[:hop_index], _moved(hop, pick(others))))


__all__ = ["Pick", "decider_route", "replay_route", "replicas"]
