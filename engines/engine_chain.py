"""Shard engines chained in one process: a step's hidden rows handed from engine to engine, as
the mesh hands them from node to node, with no network between. The parity tests hold a split
to it bit for bit, and bench/engine.py times it against the whole model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engines.interface import GREEDY, SessionKey, ShardEngine, StepRequest, StepResult


def chain_step(
    engines: Sequence[ShardEngine],
    key: SessionKey,
    position: int,
    tokens: Sequence[int],
    *,
    want_logits: bool = True,
    effective_start_layer: int | None = None,
) -> StepResult:
    """``tokens`` at ``position`` through ``engines`` in order: a prefill at position 0, else a
    decode that expects ``position`` tokens cached. Returns the tail's result, drawn greedily,
    with its logits when ``want_logits``; ``effective_start_layer`` goes to the tail only."""
    hidden = None
    result: StepResult | None = None
    for index, engine in enumerate(engines):
        tail = index == len(engines) - 1
        request = StepRequest(
            key,
            position,
            token_ids=tuple(tokens) if index == 0 else None,
            hidden=hidden,
            expected_past_len=position or None,
            effective_start_layer=effective_start_layer if tail else None,
            sampling=GREEDY if tail else None,
            want_logits=want_logits and tail,
        )
        result = engine.decode(request) if position else engine.prefill(request)
        hidden = result.hidden
    if result is None:
        raise ValueError("a chain needs at least one engine")
    return result


# The tail's logits and token after the prefill and after each greedy decode.
GreedyRun = tuple[list[np.ndarray], list[int]]


def greedy_chain(engines: Sequence[ShardEngine], prompt: Sequence[int], decode_steps: int) -> GreedyRun:
    """The prefill of ``prompt`` and ``decode_steps`` greedy decodes through ``engines``: the
    tail's logits (copied) and token after each."""
    key = SessionKey("greedy-chain", 1)
    logits: list[np.ndarray] = []
    tokens: list[int] = []
    feed, position = tuple(prompt), 0
    for _ in range(decode_steps + 1):
        result = chain_step(engines, key, position, feed)
        if result.logits is None or result.token_id is None:
            raise ValueError("the last engine of a chain must be a tail that draws a token")
        logits.append(result.logits.copy())
        tokens.append(result.token_id)
        position += len(feed)
        feed = (result.token_id,)
    return logits, tokens


__all__ = ["GreedyRun", "chain_step", "greedy_chain"]
