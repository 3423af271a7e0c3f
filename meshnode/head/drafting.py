"""Draft tokens for speculative decoding by prompt lookup: pure, no model.

The head guesses what comes next by finding the newest earlier place in the
transcript (prompt and generated tokens) where its last n tokens occurred,
and proposing the tokens that followed there (Saxena's prompt lookup decoding,
llama.cpp's ``lookup`` example). It pays on text that repeats what is already
there: code being edited, a list continued, a passage quoted back. Longer
n-grams are tried first (they predict better); nothing matched means no draft,
and the head then decodes one token as usual.

The index is incremental: every n-gram of the transcript is entered once, with
where it ended most recently, so a proposal costs a few dictionary look-ups
however long the transcript is. The transcript only grows (a generation's tokens
are never taken back), which is what lets the index trust what it has seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftConfig:
    # N-gram lengths looked up, longest first.
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("n-gram lengths must satisfy 1 <= min_ngram <= max_ngram")


class PromptLookup:
    """Proposes drafts for one transcript, which is passed whole each time and only ever grows."""

    def __init__(self, config: DraftConfig | None = None) -> None:
        self.config = config or DraftConfig()
        # n-gram -> index of its last token, at its newest occurrence entered so far.
        self._ends: dict[tuple[int, ...], int] = {}
        # N-grams ending before this index are entered.
        self._entered = 0

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that followed the newest earlier occurrence of the longest suffix
        n-gram of ``tokens``; empty when none occurred before (or ``limit`` is 0)."""
        last = len(tokens) - 1
        if limit < 1 or last < 1:
            return ()
        # Enter every n-gram that ends before the last token: the suffix itself must not match.
        self._enter(tokens, last)
        for n in range(min(self.config.max_ngram, last), self.config.min_ngram - 1, -1):
            end = self._ends.get(tuple(tokens[last - n + 1 : last + 1]))
            if end is not None:
                return _continuation(tokens, end, limit)
        return ()

    def _enter(self, tokens: Sequence[int], upto: int) -> None:
        config = self.config
        for end in range(self._entered, upto):
            for n in range(config.min_ngram, config.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self._ends[tuple(tokens[end - n + 1 : end + 1])] = end
        self._entered = max(self._entered, upto)


def _continuation(tokens: Sequence[int], end: int, limit: int) -> tuple[int, ...]:
    """The ``limit`` tokens after index ``end``. Where they run past the transcript, the draft goes
    on copying itself: a pattern repeating with period p matched p tokens back continues as that
    pattern, so drafts on a cycle are not capped at its length."""
    draft: list[int] = []
    source = end + 1
    while len(draft) < limit:
        draft.append(tokens[source] if source < len(tokens) else draft[source - len(tokens)])
        source += 1
    return tuple(draft)


__all__ = ["DraftConfig", "PromptLookup"]
