"""Tail-side token sampling: greedy, or temperature / top-k / top-p with a seed.

A seeded draw depends only on (logits, params, sample_index), never on earlier draws, so a
retried or replayed step samples the same token.
"""

from __future__ import annotations

import math

import numpy as np

from engines.interface import EngineError, EngineErrorKind, SamplingParams


def validate_sampling(params: SamplingParams) -> None:
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise EngineError(EngineErrorKind.INVALID_REQUEST, f"temperature {params.temperature} is not >= 0")
    if params.top_k < 0:
        raise EngineError(EngineErrorKind.INVALID_REQUEST, f"top_k {params.top_k} is negative")
    if not 0.0 < params.top_p <= 1.0:
        raise EngineError(EngineErrorKind.INVALID_REQUEST, f"top_p {params.top_p} is not in (0, 1]")


def sample_token(logits: np.ndarray, params: SamplingParams, sample_index: int = 0) -> int:
    """The token for one position's logits (a 1-D float array, possibly a view into C memory)."""
    if params.greedy:
        return int(np.argmax(logits))
    vocab = logits.shape[0]
    if 0 < params.top_k < vocab:
        candidates = np.argpartition(logits, vocab - params.top_k)[vocab - params.top_k :]
    else:
        candidates = np.arange(vocab)
    scores = logits[candidates].astype(np.float64)
    # Highest score first; ties broken by token id so the order never depends on the partition.
    order = np.lexsort((candidates, -scores))
    candidates, scores = candidates[order], scores[order]
    scaled = (scores - scores[0]) / params.temperature
    probabilities = np.exp(scaled)
    probabilities /= probabilities.sum()
    if params.top_p < 1.0:
        cumulative = np.cumsum(probabilities)
        keep = int(np.searchsorted(cumulative, params.top_p)) + 1
        candidates, probabilities = candidates[:keep], probabilities[:keep]
        probabilities /= probabilities.sum()
    rng = np.random.default_rng([params.seed & 0xFFFFFFFFFFFFFFFF, sample_index])
    draw = rng.random()
    index = int(np.searchsorted(np.cumsum(probabilities), draw, side="right"))
    return int(candidates[min(index, len(candidates) - 1)])
