"""What gossip says about shards, as the planner's candidates. Pure.

A peer announcement becomes a :class:`~meshnode.head.planner.ShardCandidate`
only when it names a served range with a real fingerprint; a peer that is not
serving (loading, draining, dark) is kept out of new routes.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshnode.head.planner import ModelIdentity, NoRouteError, ShardCandidate, models_available, plan_route
from meshnode.mesh.peer_table import PeerEntry
from meshnode.mesh.serving_states import ACCEPTING_STATES
from meshnode.transport.addresses import AddressError, parse_host_port
from meshnode.wire.cpu_mask import cpus_of_mask
from meshnode.wire.pb import mesh, shard

# Serving states a peer may announce and still take new sessions. UNSPECIFIED is
# what a node announces before its first load report.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


def model_identity(served: mesh.ServedShard) -> ModelIdentity:
    fingerprint = served.fingerprint
    return ModelIdentity(
        model_artifact_digest=fingerprint.model_artifact_digest,
        runtime_recipe_digest=fingerprint.runtime_recipe_digest,
        total_layers=served.total_layers,
    )


def session_fingerprint(model: ModelIdentity) -> shard.Fingerprint:
    """The fingerprint a session names: workers compare the two digests only."""
    return shard.Fingerprint(
        model_artifact_digest=model.model_artifact_digest,
        runtime_recipe_digest=model.runtime_recipe_digest,
    )


def shard_candidate(
    node_id: bytes, announcement: mesh.PeerAnnouncement, *, rtt_ms: float | None = None
) -> ShardCandidate | None:
    """The candidate a peer's announcement offers, or None when it serves nothing routable."""
    if not announcement.HasField("serving"):
        return None
    served = announcement.serving
    if not served.fingerprint.model_artifact_digest or not served.fingerprint.runtime_recipe_digest:
        return None
    span = served.shard_range
    if not 0 <= span.start_layer < span.end_layer <= served.total_layers:
        return None
    return ShardCandidate(
        node_id=node_id,
        model_name=served.model_name,
        model=model_identity(served),
        start_layer=span.start_layer,
        end_layer=span.end_layer,
        # A node's own record says nothing of our round trip to it; 0 until measured.
        rtt_ms=0.0 if rtt_ms is None else rtt_ms,
        active_sessions=announcement.load.active_sessions,
        max_sessions=announcement.capacity.max_concurrent_sessions,
        accepting=announcement.load.serving_state in ACCEPTING_STATES,
        numerics=served.numerics,
        max_context_tokens=announcement.capacity.max_context_tokens,
        verifies_drafts=served.verifies_drafts,
        states_handoffs=served.states_handoffs,
        keeps_partial_blocks=served.keeps_partial_blocks,
        hosts=announced_hosts(announcement.addresses),
        compute_threads=served.compute_threads,
        cpus=cpus_of_mask(served.cpu_mask),
        # Validated on receipt (meshnode.mesh.validation.validate_stage_speed): within bounds.
        decode_ms_per_token=served.speed.decode_us_per_token / 1_000 if served.HasField("speed") else 0.0,
        prefill_ms_per_token=served.speed.prefill_us_per_token / 1_000 if served.HasField("speed") else 0.0,
    )


def announced_hosts(addresses: Iterable[str]) -> frozenset[str]:
    """The host part of each ``host:port`` (``[v6]:port``) address a peer announces; a wildcard
    (0.0.0.0, ::) names no machine and is left out."""
    hosts = set()
    for address in addresses:
        try:
            host, _ = parse_host_port(address)
        except AddressError:
            continue
        if host.lower() not in _WILDCARD_HOSTS:
            hosts.add(host.lower())
    return frozenset(hosts)


def shard_candidates(announcements: Iterable[tuple[bytes, mesh.PeerAnnouncement]]) -> list[ShardCandidate]:
    """Candidates from ``(node id, announcement)`` pairs (this node's own included)."""
    found = (shard_candidate(node_id, announcement) for node_id, announcement in announcements)
    return [candidate for candidate in found if candidate is not None]


def stating_handoffs(candidates: Iterable[ShardCandidate]) -> list[ShardCandidate]:
    """The candidates that announce they sign handoffs: all a head routes through when the mesh
    policy requires handoffs. A hop that does not would have its units refused by the next hop
    (meshnode.dataplane.handoff_check), and the head's failover re-plans on the same candidates, so
    leaving it out here is what keeps such a route from being planned over and over."""
    return [candidate for candidate in candidates if candidate.states_handoffs]


class CandidateIndex:
    """The candidates a peer table offers, each built again only when its node's record changed.

    Building a candidate reads its whole announcement (addresses, CPU mask, fingerprint): over a
    1,024-member table that was about nine tenths of planning a route (bench/scale.py), and
    the table's records change a few at a time (under delta gossip, only when their content
    does). A record is known by its signature: the table replaces a node's record only with a
    fresher one, and one signature signs one content.
    """

    def __init__(self) -> None:
        self._held: dict[bytes, tuple[bytes, ShardCandidate | None]] = {}

    def candidates(self, entries: Iterable[PeerEntry]) -> list[ShardCandidate]:
        """The candidates of ``entries`` (a peer table's), in their order."""
        held: dict[bytes, tuple[bytes, ShardCandidate | None]] = {}
        found = []
        for entry in entries:
            peer_id = entry.peer_id
            signature = entry.record.signature
            kept = self._held.get(peer_id)
            if kept is None or kept[0] != signature:
                kept = (signature, shard_candidate(peer_id, entry.announcement))
            held[peer_id] = kept
            if kept[1] is not None:
                found.append(kept[1])
        # Only the entries of this table: a node gone from it is forgotten here too.
        self._held = held
        return found


def routable_models(candidates: Iterable[ShardCandidate]) -> dict[ModelIdentity, set[str]]:
    """Models some chain of candidates covers completely, with the names they are announced under."""
    pool = list(candidates)
    routable: dict[ModelIdentity, set[str]] = {}
    for model, names in models_available(pool).items():
        try:
            plan_route(pool, model)
        except NoRouteError:
            continue
        routable[model] = names
    return routable


def identities_for_artifact(
    candidates: Iterable[ShardCandidate], artifact_digest: str
) -> list[ModelIdentity]:
    """Every fingerprint (one per hop contract) under which the artifact is served, stable order.

    Numerics are not part of it: a CPU node and a GPU node serving one recipe are one identity."""
    found = {c.model for c in candidates if c.model.model_artifact_digest == artifact_digest}
    return sorted(found, key=lambda m: (m.runtime_recipe_digest, m.total_layers))


__all__ = [
    "CandidateIndex",
    "announced_hosts",
    "identities_for_artifact",
    "model_identity",
    "routable_models",
    "session_fingerprint",
    "shard_candidate",
    "shard_candidates",
]
