"""What the head's generations did, counted (:class:`DriverStats`: the console, /metrics and tests read it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshnode.head.route_control import CancelReport


@dataclass
class DriverStats:
    started: int = 0
    active: int = 0
    completed: int = 0
    # Closed by the consumer while a unit was running: cancelled on every hop.
    cancelled: int = 0
    # Closed by the consumer between tokens (it had what it wanted).
    closed: int = 0
    failed: int = 0
    # Refused before they started: every route at capacity, or the head at its limit.
    busy: int = 0
    # New sessions a shard refused for capacity (each sent the generation to another replica).
    capacity_refusals: int = 0
    tokens: int = 0
    # Prompt tokens of the generations started.
    prompt_tokens: int = 0
    # Tokens that came straight from the tail on its answer stream (the rest came along the route).
    direct_tokens: int = 0
    # Speculative decoding: verify rounds sent, draft tokens in them, drafts the tail accepted.
    speculative_rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    rebuilds: int = 0
    reroutes: int = 0
    # Prefix cache: prefills started from a prefix the route's hops kept, those a hop no longer
    # held (each then prefilled from position 0), the prompt tokens not prefilled again, and the
    # routes that were chosen over a cheaper one for the prefix they hold.
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_cached_tokens: int = 0
    prefix_route_preferred: int = 0
    # Answers prefilled after their kept prompts (meshnode.head.answer_keeping), their tokens,
    # those given up, and next turns that waited for theirs.
    answers_kept: int = 0
    answer_tokens_kept: int = 0
    answers_not_kept: int = 0
    answer_waits: int = 0
    # Routes opened (every epoch of every generation) by how their stages run: in pipeline
    # cohorts, or every session in one batch a stage; and the last one's cohorts (0: one batch).
    routes_in_cohorts: int = 0
    routes_in_one_batch: int = 0
    last_route_cohorts: int = 0
    replay_mismatches: int = 0
    last_route: tuple[str, ...] = ()
    # Per hop of last_route: how it computes (its announced numerics).
    last_route_numerics: tuple[str, ...] = ()
    last_system_fingerprint: str = ""
    last_cancel: CancelReport | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["DriverStats"]
