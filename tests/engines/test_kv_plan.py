"""The sessions a shard is planned to hold (meshnode.dataplane.kv_budget) cost what llama.cpp
then allocates for them: a non-tail slice's passthrough layer, and the lead passthrough layer of
a Gemma 3 range holding only full-attention layers, carry KV caches like real layers. Planned
without them, a one-layer head took twice the KV memory its budget allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.interface import LoadRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import TINY_N_LAYERS
from meshnode.dataplane.kv_budget import shard_session_plan

N_CTX = 512
SESSIONS = 3
# llama.cpp logs each KV buffer in MiB with two decimals.
LOGGED_ROUNDING = 0.01 * 2**20


def allocated_kv_bytes(model: Path, layers: tuple[int, int] | None, tmp_path: Path) -> int:
    engine = LlamaShardEngine()
    start, end = layers if layers is not None else (0, None)
    engine.load(
        LoadRequest(
            str(model), start, end, n_ctx=N_CTX, n_seq_max=SESSIONS, n_threads=1, cache_dir=str(tmp_path)
        )
    )
    try:
        return engine.memory_budget().kv_bytes
    finally:
        engine.close()


@pytest.mark.parametrize(
    "layers",
    [None, (0, 1), (2, 4), (TINY_N_LAYERS - 1, TINY_N_LAYERS)],
    ids=["whole", "head", "middle", "tail"],
)
def test_the_planned_kv_is_what_llama_cpp_allocates_for_a_tiny_models_ranges(tiny_model, tmp_path, layers):
    planned = shard_session_plan(tiny_model, layers, N_CTX, chosen=SESSIONS).per_session_bytes * SESSIONS
    assert abs(allocated_kv_bytes(tiny_model, layers, tmp_path) - planned) <= LOGGED_ROUNDING


@pytest.mark.parametrize("layers", [(0, 4), (5, 6)], ids=["head", "full-attention-only"])
def test_the_planned_kv_is_what_llama_cpp_allocates_for_gemma_ranges(gemma_model, tmp_path, layers):
    planned = shard_session_plan(gemma_model, layers, N_CTX, chosen=SESSIONS).per_session_bytes * SESSIONS
    assert abs(allocated_kv_bytes(gemma_model, layers, tmp_path) - planned) <= LOGGED_ROUNDING
