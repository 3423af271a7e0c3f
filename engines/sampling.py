"""Tail-side token sampling: greedy, or temperature / top-k / top-p / min-p with a seed, after
llama.cpp's logit adjustments (logit bias, then repeat / frequency / presence penalties).

A seeded draw depends only on (logits, params, sample_index), never on earlier draws, so a
retried or replayed step samples the same token. The penalties depend on the tokens before the
sampled position, which the caller passes in ``params.recent_tokens``; those are the same on a
retry or a replay, so the same token is drawn again.

The adjustments run in numpy on a copy of the logits rather than through llama.cpp's sampler
objects: those keep their own token history, which a retried, replayed or re-routed step would
have to rebuild, and a request with no adjustment would no longer be the bare argmax it is now
(bit-identical greedy output is what the parity tests pin). The arithmetic is llama.cpp's
(``llama_sampler_penalties_apply``, float32).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from engines.interface import EngineError, EngineErrorKind, GrammarSource, GrammarState, SamplingParams
from engines.request_limits import MAX_GRAMMAR_BYTES, MAX_PENALTY_LAST_N


def _invalid(message: str) -> EngineError:
    return EngineError(EngineErrorKind.INVALID_REQUEST, message)


def validate_sampling(params: SamplingParams) -> None:
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise _invalid(f"temperature {params.temperature} is not >= 0")
    if params.top_k < 0:
        raise _invalid(f"top_k {params.top_k} is negative")
    if not 0.0 < params.top_p <= 1.0:
        raise _invalid(f"top_p {params.top_p} is not in (0, 1]")
    if not 0.0 <= params.min_p <= 1.0:
        raise _invalid(f"min_p {params.min_p} is not in [0, 1]")
    if not math.isfinite(params.repeat_penalty) or params.repeat_penalty <= 0:
        raise _invalid(f"repeat_penalty {params.repeat_penalty} is not > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise _invalid(f"{name} is not finite")
    if not 0 <= params.penalty_last_n <= MAX_PENALTY_LAST_N:
        raise _invalid(f"penalty_last_n {params.penalty_last_n} is not in [0, {MAX_PENALTY_LAST_N}]")
    if len(params.recent_tokens) > params.penalty_last_n:
        raise _invalid("more recent tokens than the penalty window")
    if any(not math.isfinite(bias) for _, bias in params.logit_bias):
        raise _invalid("a logit bias is not finite")
    if len(params.grammar) > MAX_GRAMMAR_BYTES:
        raise _invalid(f"the grammar is longer than {MAX_GRAMMAR_BYTES} bytes")


def adjusted_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """A float32 copy of ``logits`` with the bias and penalties applied (the input is untouched:
    it may be a view into the engine's memory)."""
    adjusted = np.array(logits, dtype=np.float32, copy=True)
    vocab = adjusted.shape[0]
    for token, bias in params.logit_bias:
        if 0 <= token < vocab:
            adjusted[token] += np.float32(bias)
    if params.penalized and params.recent_tokens:
        counts = Counter(t for t in params.recent_tokens if 0 <= t < vocab)
        tokens = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        repeats = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        values = adjusted[tokens]
        repeat = np.float32(params.repeat_penalty)
        values = np.where(values <= 0, values * repeat, values / repeat)
        values -= repeats * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty)
        adjusted[tokens] = values
    return adjusted


def recent_window(tokens: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
    """The last ``penalty_last_n`` of ``tokens`` (nothing when no penalty applies)."""
    if not params.penalized:
        return ()
    return tuple(tokens[-params.penalty_last_n :])


def sample_token(
    logits: np.ndarray,
    params: SamplingParams,
    sample_index: int = 0,
    grammars: GrammarSource | None = None,
) -> int:
    """The token for one position's logits (a 1-D float array, possibly a view into C memory).

    ``sample_index`` is the position of the sampled token; with a history the penalties look
    at the tokens before it, a grammar stands where those tokens left it, and the drawn token
    is recorded there. ``grammars`` builds the engine's state for a grammar (over its model's
    vocabulary), the first time a session samples to one."""
    history = params.history
    if history is None:
        if params.grammar:
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "a grammar needs the session's history")
        return _draw(_adjusted(logits, params), params, sample_index)
    step = history.params_at(sample_index)
    adjusted = _adjusted(logits, step)
    token = _draw(adjusted, step, sample_index)
    if step.grammar:
        grammar = history.grammar_at(sample_index, grammars)
        if not grammar.allows(token):
            # As llama.cpp's common sampler: mask everything only when the free choice is refused.
            token = _draw(grammar.masked(adjusted), step, sample_index)
    history.record(sample_index, token)
    return token


def _adjusted(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return adjusted_logits(logits, params) if params.adjusts_logits else logits


def _draw(logits: np.ndarray, params: SamplingParams, sample_index: int) -> int:
    """The seeded draw. Candidates stay in token-id order, and only top-p needs an order by
    probability, found for the few tokens the nucleus holds (:func:`_nucleus`): sorting the
    whole vocabulary took 48 ms a token on Gemma's 262 144 (more than the model's compute)."""
    if params.greedy:
        return int(np.argmax(logits))
    vocab = logits.shape[0]
    if 0 < params.top_k < vocab:
        candidates = np.sort(np.argpartition(logits, vocab - params.top_k)[vocab - params.top_k :])
        scores = logits[candidates].astype(np.float64)
    else:
        candidates = np.arange(vocab)
        scores = logits.astype(np.float64)
    weights = np.exp((scores - scores.max()) / params.temperature)
    if params.top_p < 1.0:
        kept = _nucleus(weights, params.top_p)
        candidates, weights = candidates[kept], weights[kept]
    if params.min_p > 0.0:
        # Relative to the best token, which every earlier cut keeps: no order needed.
        kept = weights >= params.min_p * weights.max()
        candidates, weights = candidates[kept], weights[kept]
    rng = np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, sample_index])
    draw = rng.random()
    cumulative = np.cumsum(weights / weights.sum())
    index = int(np.searchsorted(cumulative, draw, side="right"))
    return int(candidates[min(index, len(candidates) - 1)])


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the most probable ``weights`` (ties by index) whose share first reaches
    ``top_p``, most probable first: the smallest such prefix of the full descending order,
    found among the top m for m = 64, 256, ... rather than by sorting everything."""
    target = top_p * weights.sum()
    size = weights.shape[0]
    m = 64
    while True:
        top = np.arange(size) if m >= size else np.argpartition(-weights, m - 1)[:m]
        top = top[np.lexsort((top, -weights[top]))]
        cumulative = np.cumsum(weights[top])
        if cumulative[-1] >= target or m >= size:
            keep = min(int(np.searchsorted(cumulative, target)) + 1, len(top))
            last = weights[top[keep - 1]]
            # A token outside the top m tied with the last kept one could precede it by index.
            if m >= size or np.count_nonzero(weights >= last) == keep:
                return top[:keep]
        m *= 4


class SamplingHistory:
    """What one tail session's sampler looks back on: the tokens its route was opened with (the
    prompt's last ones, ``base.recent_tokens``, ending at ``base.recent_tokens_end``) and every
    token it sampled since, by position; and, with a grammar, the grammar's state after them.

    A retried step records the same token at the same position again; a replay after a
    re-prefill samples the generated tokens again in order, so the history is rebuilt by the
    same steps that rebuild the cache (the grammar is reset and fed the recorded tokens when
    a step asks for an earlier position than it stands at). Without a grammar only the last
    ``penalty_last_n`` positions are kept."""

    def __init__(self, base: SamplingParams) -> None:
        self.base = replace(base, history=None)
        self._sampled: dict[int, int] = {}
        self._grammar: GrammarState | None = None
        # The grammar has accepted the tokens at [base.recent_tokens_end, _grammar_at).
        self._grammar_at = base.recent_tokens_end

    def params_at(self, position: int) -> SamplingParams:
        """The parameters for sampling the token at ``position``, with the tokens before it."""
        base = self.base
        if not base.penalized:
            return base
        given_start = base.recent_tokens_end - len(base.recent_tokens)
        window: list[int] = []
        for earlier in range(max(0, position - base.penalty_last_n), position):
            if given_start <= earlier < base.recent_tokens_end:
                window.append(base.recent_tokens[earlier - given_start])
            elif (token := self._sampled.get(earlier)) is not None:
                window.append(token)
        return replace(base, recent_tokens=tuple(window), recent_tokens_end=position)

    def grammar_at(self, position: int, grammars: GrammarSource | None) -> GrammarState:
        """The grammar as it stands before the token at ``position``."""
        if self._grammar is None:
            grammar = grammars(self.base.grammar) if grammars is not None else None
            if grammar is None:
                raise EngineError(EngineErrorKind.INVALID_REQUEST, "this engine cannot sample to a grammar")
            self._grammar = grammar
        if position < self._grammar_at:
            self._grammar.reset()
            self._grammar_at = self.base.recent_tokens_end
        while self._grammar_at < position:
            token = self._sampled.get(self._grammar_at)
            if token is None:
                raise EngineError(
                    EngineErrorKind.INVALID_REQUEST,
                    f"no sampled token at position {self._grammar_at} to rebuild the grammar state from",
                )
            self._grammar.accept(token)
            self._grammar_at += 1
        return self._grammar

    def record(self, position: int, token: int) -> None:
        base = self.base
        if base.grammar:
            self._sampled[position] = token
            if self._grammar is not None and position == self._grammar_at:
                self._grammar.accept(token)
                self._grammar_at += 1
            return
        if not base.penalized:
            return
        self._sampled[position] = token
        oldest = position + 1 - base.penalty_last_n
        for stale in [p for p in self._sampled if p < oldest]:
            del self._sampled[stale]


def with_history(params: SamplingParams) -> SamplingParams:
    """``params`` with a fresh history for one tail session (unchanged when nothing needs one)."""
    if not (params.penalized or params.grammar):
        return params
    return replace(params, history=SamplingHistory(params))


def with_prompt_history(params: SamplingParams, prompt: Sequence[int]) -> SamplingParams:
    """``params`` carrying where the prompt ends and, for the penalties, its last tokens
    (llama-server counts the prompt in the penalty window too); unchanged when neither a
    penalty nor a grammar applies."""
    if not (params.penalized or params.grammar):
        return params
    return replace(params, recent_tokens=recent_window(prompt, params), recent_tokens_end=len(prompt))
