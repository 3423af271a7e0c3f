"""A verify step computes up to 7 positions in one pass, which llama.cpp rounds row by row as
its one-token decodes (engines.row_invariance); greedy text stays plain decoding's bit for bit
(issue 20)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from batch_parity import skip_unless_repacked_weights_run
from helpers.tiny_llama import run_unsplit

from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.row_invariance import (
    REPACKED_MAX_ROWS,
    ROW_INVARIANT_MAX_ROWS,
    check_band,
    session_passes,
    verify_passes,
)

# Two threads, as a node runs: with one, llama.cpp's split-KV attention (the reason the V
# cache is bf16 on the CPU) has a single part and would round like a multi-row pass anyway.
THREADS = 2


def test_passes_take_up_to_max_rows_each_in_order():
    assert verify_passes(9, 7) == [(0, 7), (7, 2)]
    assert verify_passes(3, 7) == [(0, 3)]
    assert verify_passes(4, 1) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert verify_passes(4, 0) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert verify_passes(16, ROW_INVARIANT_MAX_ROWS) == [(0, 7), (7, 7), (14, 2)]


def test_a_pass_is_checked_once_per_size_below_and_across_position_256():
    assert check_band(10, 7) == (7, False)
    assert check_band(249, 7) == (7, False)  # positions 249..255
    assert check_band(250, 7) == (7, True)  # reaches 256
    assert check_band(600, 2) == (2, True)


def test_session_passes_span_at_most_max_rows_slots_lowest_first():
    assert session_passes([0, 1, 2], 7) == [[0, 1, 2]]
    # Slots 0..6 in one pass (gaps filled: 7 rows), 7 and 9 in the next.
    assert session_passes([9, 0, 6, 7, 3], 7) == [[1, 4, 2], [3, 0]]
    assert session_passes([0, 7, 14], 7) == [[0], [1], [2]]
    assert session_passes([5, 4], 1) == [[1], [0]]
    assert session_passes([], 7) == []


def load(model: Path, start: int, end: int, *, weight_repack: bool = False) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    request = LoadRequest(
        str(model), start, end, n_ctx=1024, n_seq_max=2, n_threads=THREADS, weight_repack=weight_repack
    )
    engine.load(request)
    return engine


def verify(engine: LlamaShardEngine, prompt: tuple[int, ...], tokens: list[int], *, tail: bool):
    key = SessionKey("verify", 1)
    engine.prefill(StepRequest(session=key, first_position=0, token_ids=prompt))
    return engine.prefill(
        StepRequest(
            session=key,
            first_position=len(prompt),
            token_ids=tuple(tokens),
            sampling=GREEDY if tail else None,
            want_logits=tail,
            draft_tokens=len(tokens) - 1,
        )
    )


@pytest.mark.slow
def test_a_gemma_verify_step_past_position_256_is_plain_decoding(
    gemma_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Twelve positions from 250, across 256, from where a lone decode over a K/V cache of one
    type would split its attention across threads: passes of 7 and 5 rows; every choice and
    the last logits are what one-token decodes give, and the passes were checked and kept.
    (Measured the same from position 600.)"""
    engine = load(gemma_model, 0, 18)
    try:
        prompt = (2, *range(1000, 1249))
        tokens, logits = run_unsplit(engine, list(prompt), chunk_tokens=len(prompt), decode_steps=12)
        with caplog.at_level(logging.INFO, logger="engines.llama_engine"):
            result = verify(engine, prompt, tokens[:12], tail=True)
        assert result.token_ids == tuple(tokens[1:13])
        assert np.array_equal(result.logits, logits[-1])
        assert "a 7-row verify pass computes exactly what one-token decodes do" in caplog.text
        assert "a 5-row verify pass computes exactly what one-token decodes do" in caplog.text
        assert engine._verify_rows == ROW_INVARIANT_MAX_ROWS
    finally:
        engine.close()


@pytest.mark.slow
def test_a_pass_that_rounds_otherwise_is_caught_and_verify_falls_back_to_one_row(
    gemma_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Twelve rows in one pass take ggml's tiled k-quant kernel, which rounds otherwise: the
    engine's check finds it, keeps the one-token rows and runs one row a pass from then on."""
    engine = load(gemma_model, 0, 9)
    try:
        prompt = (2, *range(1000, 1040))
        key = SessionKey("plain", 1)
        engine.prefill(StepRequest(session=key, first_position=0, token_ids=prompt))
        drafts = list(range(3000, 3012))
        plain = [
            engine.decode(
                StepRequest(
                    session=key,
                    first_position=len(prompt) + i,
                    token_ids=(token,),
                    expected_past_len=len(prompt) + i,
                )
            ).hidden
            for i, token in enumerate(drafts)
        ]
        engine._verify_rows = 12  # what an engine trusting the wrong limit would do
        with caplog.at_level(logging.WARNING, logger="engines.llama_engine"):
            result = verify(engine, prompt, drafts, tail=False)
        assert result.hidden is not None and np.array_equal(result.hidden, np.concatenate(plain))
        assert "12-row pass does not round as its one-token decodes" in caplog.text
        assert engine._verify_rows == 1
    finally:
        engine.close()


@pytest.mark.slow
def test_a_gemma_verify_step_with_repacked_weights_is_plain_decoding(
    gemma_model: Path, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Repacked weights multiply four rows or more with another kernel (gemm): a verify step
    runs in passes of three, each row what a one-token decode there computes."""
    skip_unless_repacked_weights_run(gemma_model, tmp_path, THREADS)
    engine = load(gemma_model, 0, 18, weight_repack=True)
    try:
        prompt = (2, *range(1000, 1040))
        tokens, logits = run_unsplit(engine, list(prompt), chunk_tokens=len(prompt), decode_steps=12)
        with caplog.at_level(logging.INFO, logger="engines.llama_engine"):
            result = verify(engine, prompt, tokens[:12], tail=True)
        assert result.token_ids == tuple(tokens[1:13])
        assert np.array_equal(result.logits, logits[-1])
        assert "a 3-row verify pass computes exactly what one-token decodes do" in caplog.text
        assert engine._verify_rows == REPACKED_MAX_ROWS
    finally:
        engine.close()
