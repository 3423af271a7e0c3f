"""A prefill and greedy decodes through a chain of engines in one process: each step's logits and token."""

from __future__ import annotations

import numpy as np

from engines.engine_chain import chain_step
from engines.interface import SessionKey, ShardEngine

Run = tuple[list[np.ndarray], list[int]]


def greedy_chain(engines: list[ShardEngine], prompt: tuple[int, ...], decode_steps: int) -> Run:
    """The tail's logits and token after the prefill of ``prompt`` and after each of ``decode_steps``
    greedy decodes, hidden states handed engine to engine."""
    key = SessionKey("greedy-chain", 1)
    logits: list[np.ndarray] = []
    tokens: list[int] = []
    inputs, position = prompt, 0
    for _ in range(decode_steps + 1):
        result = chain_step(engines, key, position, inputs)
        assert result.logits is not None and result.token_id is not None
        logits.append(result.logits.copy())
        tokens.append(result.token_id)
        position += len(inputs)
        inputs = (result.token_id,)
    return logits, tokens


__all__ = ["Run", "greedy_chain"]
