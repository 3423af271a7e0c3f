"""Route planning: pick a chain of shards that covers every layer of a model.

Pure and deterministic. The input is what gossip says each peer serves; the
output is an ordered list of hops, each told where to start executing
(``effective_start_layer``) so that overlapping ranges never apply a layer
twice. Among the chains that cover ``[0, total_layers)`` the cheapest wins,
where a hop costs a fixed per-hop overhead plus its round-trip time plus a
load penalty plus its compute time: fewer, closer, idler, faster hops first.
Load is a shard's share of its capacity in use (active / max sessions), so of
two equal replicas of a range the less loaded takes the next session; compute
time is the decode time per token the shard announces for its range
(``ServedShard.speed``), scaled to the layers the route asks of it.

The load penalty of a shard that announces its speed is a share of that compute
(:data:`FULL_LOAD_SHARE_OF_COMPUTE` when full, at least
:data:`MIN_FULL_LOAD_PENALTY_MS`), so of two replicas one more than about that
share (and that floor) faster takes every session until it is full, small gaps
as well as large (3 ms against 9 ms as on a CPU, 30 against 90); a shard that announces no
speed keeps the fixed :data:`FULL_LOAD_PENALTY_MS` it had before speeds were
announced. Equal costs go to the lower node id, so every head plans alike.
:func:`plan_route_with_room` leaves shards at capacity out while another chain
exists: the faster replica, once full, spills to the slower.

Candidates of one model must share its :class:`ModelIdentity` (the hop contract);
their numerics (backend, weight layout, build) may differ and never bar a chain.
Each hop keeps its candidate's numerics so a route can say how it computed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from meshnode.identity import short_id
from meshnode.wire.errors import MeshnodeError

# A hop costs at least this much (ms) even on loopback: serialization, a
# network round trip, Python on both ends. It makes fewer hops win ties.
# Measured about 1.4 ms a hop on a quiet machine, 3-6 ms on a loaded one (bench/RESULTS.md).
# Fixed, not measured by the head: it sees a decode step's time for the whole route
# and the first hop's own execution time (Ack.execution_nanos), nothing per later hop,
# so what is left after the announced compute cannot be told apart per hop, nor from
# queueing behind other sessions (which the load penalty counts already).
HOP_OVERHEAD_MS = 2.0
# Load penalty (ms) for a fully loaded peer (active sessions == capacity) that announces no speed.
FULL_LOAD_PENALTY_MS = 50.0
# A full peer that announces its speed costs this share of the compute the route asks of it
# more. No more than the margin by which the mesh counts one node faster than another
# (mesh.placement.CLAIM_SPEED_MARGIN, autoplace.slow_yield.FASTER_MARGIN: 25 %), so a replica
# faster by that keeps taking sessions until it is full, while equal replicas still spread by
# load; the fixed 50 ms outweighed every gap below 50 ms and sent sessions to the slower early.
FULL_LOAD_SHARE_OF_COMPUTE = 0.25
# ... and at least this (ms), so load still outweighs round-trip differences of a fraction of a
# millisecond between equal replicas whose compute is short (a 1 ms GPU range would otherwise
# cost 0.25 ms more when full, and half a ms of round trip would pile every session on one).
MIN_FULL_LOAD_PENALTY_MS = 2.0


class NoRouteError(MeshnodeError):
    """No chain of compatible shards covers the model."""


@dataclass(frozen=True)
class ModelIdentity:
    """The exact model a route must run: both fingerprint digests and the layer count.

    The recipe digest covers the hop contract only (what activations and caches mean),
    so hops on different backends or weight layouts share one identity."""

    model_artifact_digest: str
    runtime_recipe_digest: str
    total_layers: int


@dataclass(frozen=True)
class ShardCandidate:
    node_id: bytes
    model_name: str
    model: ModelIdentity
    start_layer: int
    end_layer: int
    rtt_ms: float = 0.0
    active_sessions: int = 0
    max_sessions: int = 0
    accepting: bool = True
    # How the peer computes within the contract (ServedShard.numerics); recorded, not matched.
    numerics: str = ""
    # Tokens one session's context holds there (Capacity.max_context_tokens); 0 when not said.
    max_context_tokens: int = 0
    # It runs speculative decoding's verify steps and rollbacks (ServedShard.verifies_drafts).
    verifies_drafts: bool = False
    # It signs a handoff with what it forwards (ServedShard.states_handoffs): under a mesh policy
    # that requires handoffs, routes go only through such hops (candidates.stating_handoffs).
    states_handoffs: bool = False
    # It keeps a prompt prefix ending off the prefix grid (ServedShard.keeps_partial_blocks).
    keeps_partial_blocks: bool = False
    # The hosts of the addresses it announces (which machine it is on; empty when unsaid).
    hosts: frozenset[str] = frozenset()
    # The CPU threads its engine computes with and the CPUs its process may use
    # (ServedShard.compute_threads, .cpu_mask); 0 and empty when unsaid.
    compute_threads: int = 0
    cpus: frozenset[int] = frozenset()
    # What a decode step of its whole range takes there (ServedShard.speed), ms per token; 0 when unsaid.
    decode_ms_per_token: float = 0.0
    # What prefilling one token through its whole range takes there, ms; 0 when unsaid or not measured yet.
    prefill_ms_per_token: float = 0.0

    @property
    def load(self) -> float:
        if self.max_sessions <= 0:
            return 0.0
        return min(1.0, self.active_sessions / self.max_sessions)

    @property
    def full(self) -> bool:
        """Every session it announced is in use (a shard without a capacity is never full)."""
        return 0 < self.max_sessions <= self.active_sessions

    @property
    def cost_ms(self) -> float:
        """The hop's cost when it runs its whole range."""
        return self.cost_from_ms(self.start_layer)

    def cost_from_ms(self, position: int) -> float:
        """The hop's cost when a route enters it at layer ``position`` (it runs the rest of its range)."""
        layers = self.end_layer - max(position, self.start_layer)
        return self.link_ms + self.load_penalty_ms(layers) + self.compute_ms(layers)

    def load_penalty_ms(self, layers: int) -> float:
        """What its load adds to the hop's cost when it runs ``layers`` of its range: a share of
        their announced compute, or the fixed penalty without an announcement. Not time a
        step is expected to take (:mod:`meshnode.head.route_time` leaves it out): it spreads
        sessions over replicas whose cost is otherwise alike."""
        if self.decode_ms_per_token <= 0.0:
            return FULL_LOAD_PENALTY_MS * self.load
        full = max(FULL_LOAD_SHARE_OF_COMPUTE * self.compute_ms(layers), MIN_FULL_LOAD_PENALTY_MS)
        return full * self.load

    @property
    def link_ms(self) -> float:
        """What reaching the hop adds to a step whatever it computes: the fixed overhead and the round trip."""
        return HOP_OVERHEAD_MS + max(0.0, self.rtt_ms)

    def compute_ms(self, layers: int) -> float:
        """The announced decode time of ``layers`` of its range: a step's cost is about linear
        in the layers it runs. 0 without an announcement."""
        return self._share_of(self.decode_ms_per_token, layers)

    def prefill_ms(self, layers: int) -> float:
        """The announced prefill time of one token through ``layers`` of its range; 0 without one."""
        return self._share_of(self.prefill_ms_per_token, layers)

    def _share_of(self, whole_range_ms: float, layers: int) -> float:
        served = self.end_layer - self.start_layer
        if whole_range_ms <= 0.0 or served <= 0:
            return 0.0
        return whole_range_ms * max(0, min(layers, served)) / served


@dataclass(frozen=True)
class Hop:
    node_id: bytes
    start_layer: int
    end_layer: int
    effective_start_layer: int
    # The candidate's numerics, so the route reports how each layer range was computed.
    numerics: str = ""
    # Whether the hop runs verify steps (ShardCandidate.verifies_drafts).
    verifies_drafts: bool = False
    # ShardCandidate.hosts, .compute_threads and .cpus: whether two hops share a machine, and
    # if they do, whether it has cores for both (meshnode.head.pipeline).
    hosts: frozenset[str] = frozenset()
    compute_threads: int = 0
    cpus: frozenset[int] = frozenset()
    # Whether the hop keeps prefixes ending off the grid (ShardCandidate.keeps_partial_blocks).
    keeps_partial_blocks: bool = False


@dataclass(frozen=True)
class Route:
    model: ModelIdentity
    model_name: str
    hops: tuple[Hop, ...]

    @property
    def node_ids(self) -> tuple[bytes, ...]:
        return tuple(hop.node_id for hop in self.hops)

    @property
    def keeps_partial_blocks(self) -> bool:
        """Every hop keeps a prefix ending off the prefix grid (prefix cache)."""
        return bool(self.hops) and all(hop.keeps_partial_blocks for hop in self.hops)


def models_available(candidates: Iterable[ShardCandidate]) -> dict[ModelIdentity, set[str]]:
    """Every model some peer serves, with the names it is announced under."""
    models: dict[ModelIdentity, set[str]] = {}
    for candidate in candidates:
        models.setdefault(candidate.model, set()).add(candidate.model_name)
    return models


def plan_route(
    candidates: Iterable[ShardCandidate],
    model: ModelIdentity,
    *,
    exclude: frozenset[bytes] = frozenset(),
) -> Route:
    """The cheapest chain covering ``[0, model.total_layers)``, or :class:`NoRouteError`."""
    pool = [c for c in candidates if c.node_id not in exclude]
    chain = _cheapest_chain(pool, model)
    if chain is None:
        raise NoRouteError(_explain_gap(pool, model))
    hops: list[Hop] = []
    position = 0
    for candidate in chain:
        hops.append(
            Hop(
                candidate.node_id,
                candidate.start_layer,
                candidate.end_layer,
                position,
                candidate.numerics,
                candidate.verifies_drafts,
                candidate.hosts,
                candidate.compute_threads,
                candidate.cpus,
                candidate.keeps_partial_blocks,
            )
        )
        position = candidate.end_layer
    name = chain[0].model_name
    return Route(model=model, model_name=name, hops=tuple(hops))


def plan_route_with_room(
    candidates: Iterable[ShardCandidate],
    model: ModelIdentity,
    *,
    exclude: frozenset[bytes] = frozenset(),
) -> Route:
    """:func:`plan_route` among the shards with a session free; when only full ones complete a
    chain, among all of them: a load record is a heartbeat old, and the shard's own admission
    decides."""
    pool = list(candidates)
    full = frozenset(c.node_id for c in pool if c.full)
    if full:
        try:
            return plan_route(pool, model, exclude=exclude | full)
        except NoRouteError:
            pass
    return plan_route(pool, model, exclude=exclude)


def _usable(candidates: Iterable[ShardCandidate], model: ModelIdentity) -> list[ShardCandidate]:
    return [
        c
        for c in candidates
        if c.model == model and c.accepting and 0 <= c.start_layer < c.end_layer <= model.total_layers
    ]


def _cheapest_chain(candidates: list[ShardCandidate], model: ModelIdentity) -> list[ShardCandidate] | None:
    """Dijkstra over layer positions: a shard moves the route from any position
    inside its range to its end. Ties break on node id, so plans are stable."""
    usable = sorted(_usable(candidates, model), key=lambda c: (c.start_layer, c.end_layer, c.node_id))
    goal = model.total_layers
    best: dict[int, tuple[float, int, tuple[bytes, ...]]] = {0: (0.0, 0, ())}
    chains: dict[int, list[ShardCandidate]] = {0: []}
    frontier: list[tuple[float, int, tuple[bytes, ...], int]] = [(0.0, 0, (), 0)]
    while frontier:
        cost, hop_count, ids, position = heapq.heappop(frontier)
        if (cost, hop_count, ids) != best.get(position):
            continue
        if position == goal:
            return chains[position]
        for candidate in usable:
            if not candidate.start_layer <= position < candidate.end_layer:
                continue
            key = (cost + candidate.cost_from_ms(position), hop_count + 1, (*ids, candidate.node_id))
            end = candidate.end_layer
            if end not in best or key < best[end]:
                best[end] = key
                chains[end] = [*chains[position], candidate]
                heapq.heappush(frontier, (*key, end))
    return None


def _explain_gap(candidates: list[ShardCandidate], model: ModelIdentity) -> str:
    usable = _usable(candidates, model)
    reach = 0
    changed = True
    while changed:
        changed = False
        for c in usable:
            if c.start_layer <= reach < c.end_layer:
                reach = c.end_layer
                changed = True
    served = ", ".join(
        f"[{c.start_layer},{c.end_layer})" for c in sorted(usable, key=lambda c: c.start_layer)
    )
    return (
        f"no route covers layers [{reach}, {model.total_layers}) of the model "
        f"(usable shards: {served or 'none'}){_other_files_at(candidates, model, reach)}"
    )


def _other_files_at(candidates: list[ShardCandidate], model: ModelIdentity, layer: int) -> str:
    """Where shards of another file (or recipe) hold the missing ``layer``: the likeliest cause of
    a gap a person believes is covered, such as a node started with another quantization or copy."""
    others = sorted(
        (
            c
            for c in candidates
            if c.model != model
            and c.model.total_layers == model.total_layers
            and c.start_layer <= layer < c.end_layer
        ),
        key=lambda c: c.node_id,
    )
    if not others:
        return ""
    described = []
    for c in others[:3]:
        if c.model.model_artifact_digest == model.model_artifact_digest:
            what = f"the same file under another runtime recipe ({c.model.runtime_recipe_digest[:12]}…)"
        else:
            what = f"another file, fingerprint {c.model.model_artifact_digest[:12]}…"
        described.append(f"node {short_id(c.node_id)} serves [{c.start_layer},{c.end_layer}) of {what}")
    return (
        f"; {'; '.join(described)}: every shard of a route must load the same GGUF as this one "
        f"(fingerprint {model.model_artifact_digest[:12]}…)"
    )
