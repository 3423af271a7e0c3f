"""How the head drives generations (:class:`DriverConfig`), apart from the driver so that the
command line reads its defaults without loading the head."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.request_limits import MAX_DRAFT_TOKENS
from meshnode.head.pipeline import MAX_PIPELINE_COHORTS, PIPELINE_MODES
from meshnode.head.recovery import RecoveryBudget
from meshnode.wire.pb import shard


@dataclass(frozen=True)
class DriverConfig:
    boundary_dtype: int = shard.DTYPE_FLOAT32
    # Envelope deadline of one unit; units queued behind others get `queued_unit_allowance_s` more each.
    unit_timeout_s: float = 60.0
    queued_unit_allowance_s: float = 0.5
    # A unit unanswered this long makes the driver probe the route's hops.
    stall_probe_s: float = 1.0
    probe_timeout_s: float = 2.0
    # Cancel and release calls at the end of a generation.
    control_timeout_s: float = 2.0
    open_timeout_s: float = 10.0
    # A hop found dead stays out of new routes this long (gossip forgets a dead peer only after
    # its own probes); a route that exists only through it is still tried.
    dead_memory_s: float = 30.0
    budget: RecoveryBudget = field(default_factory=RecoveryBudget)
    # Generations this head runs at once; one more is refused (MeshBusy) rather than queued.
    max_generations: int = 256
    # What a refusal for capacity tells the client to wait (the API's Retry-After, seconds).
    busy_retry_after_s: int = 1
    # A generation that has produced tokens and finds every replica full waits this long for room,
    # trying again every `capacity_retry_s`, before it fails.
    capacity_wait_s: float = 30.0
    capacity_retry_s: float = 0.25
    # The tail answers the head directly on a route of more than one hop (else along the route).
    direct_answer: bool = True
    # Speculative decoding for greedy and seeded sampled requests (draft by prompt lookup,
    # verify k drafts a round trip); off: one token a round trip. draft_max bounds k (1 to
    # MAX_DRAFT_TOKENS).
    speculation: bool = True
    draft_max: int = 8
    # Speculate only while this head runs at most this many generations: a verify step
    # runs alone at each hop (no batching with other sessions' decodes), the rejected
    # positions computed for nothing, so with several sessions sharing the
    # shards the batched plain decodes give more tokens per second (bench/RESULTS.md, issue 20).
    speculation_max_generations: int = 1
    # Whether the route's stages compute different generations at once (meshnode.head.pipeline):
    # "auto" where every hop is on a machine of its own, "on", "off" (one convoy of sessions).
    pipeline: str = "auto"
    # Cohorts a pipelined route's sessions are split into (2 or more); 0: one per stage. Two:
    # on 16 cores three real nodes did 48.7 tokens/s for four generations in cohorts of one
    # against 59.3 as a convoy, the tail's vocabulary layer costing twice as much per token
    # unbatched; stages timed as those nodes measured gave 79.5 with two cohorts, 62.8 as a
    # convoy, and equal stages lost 0-4% against one cohort per stage (bench/RESULTS.md).
    pipeline_cohorts: int = 2
    # Prefix cache (meshnode.head.prefix_index): start a prefill from the prefix the route's hops
    # kept of an earlier generation, and prefer the route that holds the longest one; off: every
    # prefill starts at position 0 (its chunks fall on the same grid either way).
    prefix_cache: bool = True
    # With the prefix cache: once a generation ends, prefill its answer after its kept prompt in
    # the background, so the next turn of a chat starts after both (meshnode.head.answer_keeping);
    # a next turn arriving meanwhile waits for it at most this long.
    keep_answers: bool = True
    keep_answer_wait_s: float = 10.0
    # Audits by replica (meshnode.head.auditor): the share of finished generations whose units
    # are replayed on other replicas of their ranges and compared hop by hop, chosen after the
    # generation ended; 0 turns audits off. A generation whose route has no replica is never
    # audited. Each audit costs one more run of the generation's units (a dispute, a few more).
    audit_rate: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ValueError("audit_rate must be between 0 and 1")
        if not 1 <= self.draft_max <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_max must be between 1 and {MAX_DRAFT_TOKENS}")
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINE_MODES)}")
        if self.pipeline_cohorts != 0 and not 2 <= self.pipeline_cohorts <= MAX_PIPELINE_COHORTS:
            raise ValueError(f"pipeline_cohorts must be 0 or between 2 and {MAX_PIPELINE_COHORTS}")


__all__ = ["DriverConfig"]
