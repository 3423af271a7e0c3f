"""The load-time check behind ``EngineCapabilities.size_free_prefill``: a runtime whose rows depend
on the pass's size is caught, and the CPU engine with weights as loaded passes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.interface import LoadRequest
from engines.llama_engine import LlamaShardEngine
from engines.prefill_pass_probe import PROBE_ROWS, SPLIT_AT, prefill_passes_round_alike


class _Runtime:
    """Rows a function of their input and, when ``sized``, of the pass's size; records the passes."""

    def __init__(self, *, sized: bool, captures: bool) -> None:
        self.sized = sized
        self.captures = captures
        self.takes_embeddings = captures
        self.n_embd = 4
        self.passes: list[tuple[int, int, int]] = []
        self.truncated: list[tuple[int, int]] = []
        self._last: np.ndarray | None = None

    def run(
        self, seq_id: int, first_position: int, inputs: np.ndarray, *, want_logits: bool, logit_rows: int = 1
    ):
        self.passes.append((seq_id, first_position, len(inputs)))
        rows = np.asarray(inputs, dtype=np.float32).reshape(len(inputs), -1)
        scale = np.float32(1 + 1e-6 * len(inputs)) if self.sized else np.float32(1)
        out = rows * scale
        self._last = out
        return out if self.captures else None

    def logit_rows(self, rows: int) -> np.ndarray:
        assert self._last is not None
        return self._last[-rows:]

    def truncate(self, seq_id: int, length: int) -> None:
        self.truncated.append((seq_id, length))


@pytest.mark.parametrize("captures", [True, False])
def test_rows_that_depend_on_the_pass_size_are_caught_and_the_sequence_is_left_empty(captures: bool) -> None:
    runtime = _Runtime(sized=True, captures=captures)
    alike, difference = prefill_passes_round_alike(runtime, 0, 262_144)
    assert not alike and difference > 0
    # One pass of all the rows, then two of 8 rows or more, each from an empty sequence.
    assert runtime.passes == [(0, 0, PROBE_ROWS), (0, 0, SPLIT_AT), (0, SPLIT_AT, PROBE_ROWS - SPLIT_AT)]
    assert runtime.truncated == [(0, 0), (0, 0)]
    steady = _Runtime(sized=False, captures=captures)
    assert prefill_passes_round_alike(steady, 0, 262_144) == (True, 0.0)


@pytest.mark.parametrize("layers", [(0, None), (0, 2), (2, None)])
def test_the_cpu_engine_keeps_partial_blocks_where_its_check_passes(tiny_model: Path, layers) -> None:
    start, end = layers
    engine = LlamaShardEngine()
    try:
        engine.load(LoadRequest(str(tiny_model), start, end, n_ctx=256, n_seq_max=2, prefix_cache_entries=2))
        assert engine.capabilities().size_free_prefill
    finally:
        engine.close()
    repacked = LlamaShardEngine()
    try:
        repacked.load(
            LoadRequest(
                str(tiny_model),
                start,
                end,
                n_ctx=256,
                n_seq_max=2,
                prefix_cache_entries=2,
                weight_repack=True,
            )
        )
        assert not repacked.capabilities().size_free_prefill
    finally:
        repacked.close()


@pytest.mark.slow
def test_the_check_catches_a_real_configuration_whose_rows_depend_on_the_pass(
    gemma_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 270M with its V cache in f32: llama.cpp's attention then rounds a row otherwise in a
    pass of another size (the engine tests of partial blocks and of verify steps fail so), and the
    engine says it keeps whole blocks only."""
    import llama_cpp

    from engines import llama_runtime

    create = llama_cpp.llama_init_from_model

    def with_f32_values(model, params):
        params.type_v = llama_cpp.GGML_TYPE_F32
        return create(model, params)

    monkeypatch.setattr(llama_runtime.llama_cpp, "llama_init_from_model", with_f32_values)
    engine = LlamaShardEngine()
    try:
        engine.load(LoadRequest(str(gemma_model), 0, None, n_ctx=512, n_seq_max=2, prefix_cache_entries=2))
        assert not engine.capabilities().size_free_prefill
    finally:
        engine.close()
