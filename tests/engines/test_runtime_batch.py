"""``LlamaRuntime.run_batch``: several sequences in one ``llama_decode``, and
``ubatch_row_order``, the mirror of llama.cpp's split that says which captured row is which token.

The runtime tests use multi-token sequences of unequal lengths, where llama.cpp's ubatches list
tokens in another order than the batch: a wrong mapping hands a sequence another token's hidden
state (differences of order 1), while the tiny float32 model's batching changes only low bits
(see test_engine_batch.py), hence the tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_contract import prompt_tokens, raises_kind

from engines.gguf_file import read_gguf
from engines.interface import EngineErrorKind
from engines.llama_runtime import BatchSequence, LlamaRuntime, ubatch_row_order
from engines.slicing import ensure_slice, plan_slice
from engines.tiny_model import TINY_N_LAYERS

# Batched float32 rounding on the tiny model stays far below this; a misplaced row does not.
ROW_TOLERANCE = 1e-4

# --- ubatch_row_order (pure) ---


def test_one_token_per_adjacent_sequence_keeps_the_batch_order() -> None:
    assert ubatch_row_order([0, 1, 2, 3], 512) == [0, 1, 2, 3]


def test_unequal_lengths_split_into_equal_shares() -> None:
    # ubatch 1: one token of each of 0, 1, 2; then 0 alone (1 is used up, 2 does not follow 0); then 2.
    assert ubatch_row_order([0, 0, 0, 1, 2, 2], 512) == [0, 3, 4, 1, 2, 5]


def test_a_ubatch_takes_only_consecutive_sequence_ids() -> None:
    # 0 then 2 cannot share a ubatch; 1 follows 0, so the batch order 0, 2, 1 computes as 0, 1, 2.
    assert ubatch_row_order([0, 2, 1], 512) == [0, 2, 1]
    assert ubatch_row_order([0, 2], 512) == [0, 1]


def test_the_first_unused_token_picks_the_first_sequence() -> None:
    # Sequence 1 comes first in the batch; 0 is not 1 + 1, so 1 runs alone, then 0.
    assert ubatch_row_order([1, 0, 1, 0], 512) == [0, 2, 1, 3]


def test_n_ubatch_caps_each_share() -> None:
    assert ubatch_row_order([0, 0, 1, 1], 2) == [0, 2, 1, 3]
    assert ubatch_row_order([0, 0, 0, 0, 1, 1], 4) == [0, 1, 4, 5, 2, 3]


def test_every_index_appears_once() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        seq_ids = [int(s) for s in rng.integers(0, 5, size=int(rng.integers(1, 20)))]
        order = ubatch_row_order(seq_ids, int(rng.integers(1, 16)))
        assert sorted(order) == list(range(len(seq_ids)))
        # Each sequence's tokens keep their relative order.
        for seq_id in set(seq_ids):
            mine = [index for index in order if seq_ids[index] == seq_id]
            assert mine == sorted(mine)


# --- run_batch on the tiny model ---


@pytest.fixture(scope="module")
def head_slice(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    plan = plan_slice(TINY_N_LAYERS, 0, 3)
    assert plan is not None and plan.passthrough
    path = ensure_slice(read_gguf(tiny_model), "batch-test", plan, tmp_path_factory.mktemp("cache"))
    return path, plan.last_real_layer


def _runtime(path: Path, capture_layer: int | None, n_batch: int = 32) -> LlamaRuntime:
    return LlamaRuntime(
        path,
        n_ctx=4 * 128,
        n_seq_max=4,
        n_batch=n_batch,
        n_threads=2,
        n_gpu_layers=0,
        takes_embeddings=False,
        capture_layer=capture_layer,
    )


@pytest.fixture
def heads(head_slice: tuple[Path, int]) -> Iterator[tuple[LlamaRuntime, LlamaRuntime]]:
    path, last_layer = head_slice
    batch, solo = _runtime(path, last_layer), _runtime(path, last_layer)
    yield batch, solo
    batch.close()
    solo.close()


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.array(prompt_tokens(n, 300, seed=seed), dtype=np.int32)


def test_unequal_sequences_get_their_own_rows(heads: tuple[LlamaRuntime, LlamaRuntime]) -> None:
    batch, solo = heads
    inputs = {0: _tokens(3, 0), 1: _tokens(1, 1), 2: _tokens(2, 2)}
    # Listed out of slot order: results come back in the order asked.
    sequences = [BatchSequence(seq_id, 0, inputs[seq_id]) for seq_id in (2, 0, 1)]
    results = batch.run_batch(sequences)
    for sequence, rows in zip(sequences, results, strict=True):
        alone = solo.run(sequence.seq_id, 0, sequence.inputs, want_logits=False)
        assert rows is not None and alone is not None and rows.shape == alone.shape
        np.testing.assert_allclose(rows, alone, rtol=0, atol=ROW_TOLERANCE)
    assert [batch.cached_length(seq_id) for seq_id in range(4)] == [3, 1, 2, 0]


def test_a_gap_filler_leaves_the_gap_stream_as_it_was(heads: tuple[LlamaRuntime, LlamaRuntime]) -> None:
    batch, solo = heads
    history = _tokens(4, 9)
    for runtime in (batch, solo):
        runtime.run(1, 0, history, want_logits=False)
    results = batch.run_batch([BatchSequence(0, 0, _tokens(1, 0)), BatchSequence(2, 0, _tokens(1, 2))])
    assert all(rows is not None and rows.shape == (1, batch.n_embd) for rows in results)
    assert [batch.cached_length(seq_id) for seq_id in range(4)] == [1, 4, 1, 0]
    # The gap's next token sees exactly its own history: bit-exact with the runtime that never batched.
    step = _tokens(1, 5)
    assert np.array_equal(batch.run(1, 4, step, want_logits=False), solo.run(1, 4, step, want_logits=False))


def test_with_and_without_gap_fillers_agree(heads: tuple[LlamaRuntime, LlamaRuntime]) -> None:
    filled, unfilled = heads
    sequences = [BatchSequence(0, 0, _tokens(2, 0)), BatchSequence(3, 0, _tokens(2, 3))]
    got = filled.run_batch(sequences)
    expected = unfilled.run_batch(sequences, fill_gaps=False)
    for rows, other in zip(got, expected, strict=True):
        assert rows is not None and other is not None
        np.testing.assert_allclose(rows, other, rtol=0, atol=ROW_TOLERANCE)
    assert filled.cached_length(1) == filled.cached_length(2) == 0


def test_tail_logits_per_sequence(tiny_model: Path) -> None:
    batch, solo = _runtime(tiny_model, None), _runtime(tiny_model, None)
    try:
        inputs = {1: _tokens(2, 1), 3: _tokens(3, 3)}
        sequences = [BatchSequence(seq_id, 0, tokens, want_logits=True) for seq_id, tokens in inputs.items()]
        results = [None if logits is None else logits.copy() for logits in batch.run_batch(sequences)]
        for sequence, logits in zip(sequences, results, strict=True):
            solo.run(sequence.seq_id, 0, sequence.inputs, want_logits=True)
            assert logits is not None
            np.testing.assert_allclose(logits, solo.last_logits(), rtol=0, atol=ROW_TOLERANCE)
    finally:
        batch.close()
        solo.close()


def test_refused_batches_change_nothing(heads: tuple[LlamaRuntime, LlamaRuntime]) -> None:
    batch, _ = heads
    with raises_kind(EngineErrorKind.INVALID_REQUEST):
        batch.run_batch([BatchSequence(0, 0, _tokens(1, 0)), BatchSequence(0, 1, _tokens(1, 1))])
    with raises_kind(EngineErrorKind.INVALID_REQUEST):
        batch.run_batch([BatchSequence(0, 0, _tokens(20, 0)), BatchSequence(1, 0, _tokens(20, 1))])
    assert [batch.cached_length(seq_id) for seq_id in range(4)] == [0, 0, 0, 0]
