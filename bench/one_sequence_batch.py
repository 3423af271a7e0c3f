"""Filling a ``llama_batch`` with one sequence's tokens, for the benches that drive llama.cpp's
low-level API themselves (their monolithic baselines)."""

from __future__ import annotations

from typing import Any


def fill_one_sequence(batch: Any, tokens: list[int], first_position: int) -> None:
    """``tokens`` as sequence 0 from ``first_position``, logits asked for the last one only."""
    batch.n_tokens = len(tokens)
    for offset, token in enumerate(tokens):
        batch.token[offset] = token
        batch.pos[offset] = first_position + offset
        batch.n_seq_id[offset] = 1
        batch.seq_id[offset][0] = 0
        batch.logits[offset] = offset == len(tokens) - 1
