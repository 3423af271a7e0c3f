"""The tiny llama.cpp model's engines as the multi-node tests load them, and what it generates unsplit.

The chain tests split the tiny model's ``TINY_N_LAYERS`` (6) layers at ``SPLIT``: a head
shard ``[0, 3)`` and a tail ``[3, 6)``. ``run_unsplit`` is their reference: the whole
model on one engine, fed the prompt in the chunks a client sends.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np

from engines.interface import GREEDY, LoadRequest, SessionKey, ShardEngine, StepRequest
from engines.llama_engine import LlamaShardEngine
from helpers.step_results import sampled_token, step_logits

SPLIT = 3
CTX = 512
THREADS = 1


def load_engine(model: Path, start: int, end: int) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(model), start, end, n_ctx=CTX, n_seq_max=4, n_threads=THREADS))
    return engine


def run_unsplit(
    engine: ShardEngine, prompt: list[int], *, chunk_tokens: int, decode_steps: int
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and logits of a whole-model engine, prefilled in the chunks a client sends."""
    key = SessionKey(uuid.uuid4().hex, 0)
    chunks = [prompt[i : i + chunk_tokens] for i in range(0, len(prompt), chunk_tokens)]
    position = 0
    for index, chunk in enumerate(chunks):
        final = index == len(chunks) - 1
        result = engine.prefill(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=tuple(chunk),
                sampling=GREEDY if final else None,
                want_logits=final,
            )
        )
        position += len(chunk)
    tokens, logits = [sampled_token(result)], [step_logits(result)]
    for _ in range(decode_steps):
        result = engine.decode(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=(tokens[-1],),
                expected_past_len=position,
                sampling=GREEDY,
                want_logits=True,
            )
        )
        tokens.append(sampled_token(result))
        logits.append(step_logits(result))
        position += 1
    engine.release(key)
    return tokens, logits


__all__ = ["CTX", "SPLIT", "THREADS", "load_engine", "run_unsplit"]
