"""Speculative decoding at the head: which drafts to send, what to keep, how many next. Pure.

One round: the head sends its last accepted token and ``k`` draft tokens as one
verify step; the tail answers the model's choice after every position (greedy, or the
seeded draw a decode there would make). Each
hop computes every position exactly as a decode there would (several in one pass where
llama.cpp's kernels allow it, engines.row_invariance, else one at a time), so a round saves
round trips and per-message costs, and compute where the hops batch its positions.
:func:`accept_drafts` keeps the drafts up to the first one the model did not
choose, then the model's own choice there: 1 to k + 1 tokens per round, exactly
the tokens plain decoding would have produced one at a time.

Greedy and seeded sampled requests speculate (``engines.interface.supports_speculation``
says why keeping a draft while the seeded draw equals it is the speculative-sampling
rule for a prompt-lookup draft, and gives the seed's own text); penalised and grammar
requests decode one token per round, since their choice depends on tokens that may
be rejected drafts.

:class:`DraftLength` adapts ``k`` to what was accepted: it doubles after a fully
accepted round, falls to one more than what was accepted after a rejection,
and after ``low_rounds`` rounds in a row below ``low_acceptance`` it stops
drafting for ``pause_tokens`` tokens (a round that verifies k drafts costs more
than one decode; on text that does not repeat it would only cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshnode.head.drafting import DraftConfig, PromptLookup


def accept_drafts(draft: Sequence[int], choices: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verify round yields: ``choices[i]`` is the model's choice (greedy, or the
    seeded draw) after the round's position i (after the last accepted token, then after each draft), so the drafts
    that equal the choice before them are kept, then the choice after the last kept one."""
    if len(choices) != len(draft) + 1:
        raise ValueError(f"a round of {len(draft)} drafts is answered by {len(draft) + 1} choices")
    kept = 0
    while kept < len(draft) and draft[kept] == choices[kept]:
        kept += 1
    return tuple(choices[: kept + 1])


@dataclass(frozen=True)
class SpeculationConfig:
    # Drafts per round at most (engines.interface.MAX_DRAFT_TOKENS bounds it on the wire).
    max_draft: int = 8
    # Drafts in the first round, and after a pause.
    initial_draft: int = 4
    # Rounds in a row whose acceptance is below low_acceptance pause drafting...
    low_acceptance: float = 0.25
    low_rounds: int = 3
    # ...for this many tokens, decoded one by one.
    pause_tokens: int = 32
    drafting: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        if self.max_draft < 1 or not 1 <= self.initial_draft <= self.max_draft:
            raise ValueError("draft lengths must satisfy 1 <= initial_draft <= max_draft")


class DraftLength:
    """How many drafts the next round sends (0: decode one token plainly), from what was accepted."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.k = config.initial_draft
        self._low_streak = 0
        self._paused_for = 0

    @property
    def paused(self) -> bool:
        return self._paused_for > 0

    def next(self) -> int:
        return 0 if self._paused_for > 0 else self.k

    def decoded_plainly(self, tokens: int = 1) -> None:
        """A round without drafts yielded ``tokens``; a pause runs down by them."""
        if self._paused_for > 0:
            self._paused_for = max(0, self._paused_for - tokens)
            if self._paused_for == 0:
                self.k = self.config.initial_draft

    def verified(self, drafted: int, accepted: int) -> None:
        """A round sent ``drafted`` drafts (>= 1) and ``accepted`` of them were kept."""
        config = self.config
        if accepted >= drafted:
            self.k = min(config.max_draft, max(self.k, drafted) * 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted / drafted < config.low_acceptance:
            self._low_streak += 1
            if self._low_streak >= config.low_rounds:
                self._low_streak = 0
                self._paused_for = config.pause_tokens
        else:
            self._low_streak = 0


@dataclass
class SpeculationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """One generation's drafting: proposes a round's drafts and takes in its verdict."""

    def __init__(self, config: SpeculationConfig | None = None) -> None:
        self.config = config or SpeculationConfig()
        self.length = DraftLength(self.config)
        self.lookup = PromptLookup(self.config.drafting)
        self.stats = SpeculationStats()

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Drafts to follow ``tokens`` (the whole transcript), at most ``limit`` (what the
        generation may still yield beyond the round's own token); empty for a plain decode."""
        k = min(self.length.next(), limit)
        return self.lookup.propose(tokens, k) if k > 0 else ()

    def verified(self, draft: Sequence[int], choices: Sequence[int]) -> tuple[int, ...]:
        """The tokens the round yields (:func:`accept_drafts`); adapts the next round's length."""
        tokens = accept_drafts(draft, choices)
        accepted = len(tokens) - 1
        self.stats.rounds += 1
        self.stats.drafted += len(draft)
        self.stats.accepted += accepted
        self.length.verified(len(draft), accepted)
        return tokens

    def decoded_plainly(self) -> None:
        self.length.decoded_plainly()


__all__ = [
    "DraftLength",
    "SpeculationConfig",
    "SpeculationStats",
    "Speculator",
    "accept_drafts",
]
