"""Whether a llama.cpp runtime computes a prefill row alike in passes of different sizes.

The prefix cache keeps a prompt's partial last block only on hops whose rows do not depend on
the size of the pass that computed them, from ``MIN_SIZE_FREE_PASS_ROWS`` rows on
(``EngineCapabilities.size_free_prefill``). That was measured on one CPU and build and read in
the kernels' sources (engines.row_invariance); another CPU or build may pick other kernels by the
pass's size. So a CPU engine checks it once at load, on made-up input in a sequence no session
holds yet: ``PROBE_ROWS`` rows in one pass against the same rows in two passes of
``MIN_SIZE_FREE_PASS_ROWS`` rows or more, every hidden row (or a tail's last rows' logits) equal
bit for bit. A sample, not a proof, as every check there; a difference turns partial blocks off.
It costs two passes of a grid block at load, only where the prefix cache is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from engines.interface import MIN_SIZE_FREE_PASS_ROWS

# As many rows as a whole block of the head's prefill grid (meshnode.head.prefix_index), split at
# an odd row: a small sample misses what it should catch. With the V cache in f32, where a pass's
# rows do depend on its size beyond 32 rows or so, 24 rows as 9 + 15 and 40 as 17 + 23 came out
# equal; 64 as 27 + 37 differed, at every cache length tried (Gemma 3 270M, this CPU).
PROBE_ROWS = 128
SPLIT_AT = 45
# A tail's logits are compared for its last rows (llama_runtime returns at most 7 at once).
LOGIT_ROWS = MIN_SIZE_FREE_PASS_ROWS - 1
# Made-up token ids come from the start of the vocabulary.
TOKEN_RANGE = 1000


class ProbedRuntime(Protocol):
    captures: bool
    takes_embeddings: bool
    n_embd: int

    def run(
        self, seq_id: int, first_position: int, inputs: np.ndarray, *, want_logits: bool, logit_rows: int = 1
    ) -> np.ndarray | None: ...

    def logit_rows(self, rows: int) -> np.ndarray: ...

    def truncate(self, seq_id: int, length: int) -> None: ...


def probe_inputs(runtime: ProbedRuntime, vocab_size: int) -> np.ndarray:
    """``PROBE_ROWS`` made-up inputs, the same every time: token ids, or hidden rows."""
    rng = np.random.default_rng(52)
    if runtime.takes_embeddings:
        return rng.standard_normal((PROBE_ROWS, runtime.n_embd)).astype(np.float32)
    return rng.integers(1, max(2, min(vocab_size, TOKEN_RANGE)), PROBE_ROWS).astype(np.int32)


def prefill_passes_round_alike(runtime: ProbedRuntime, seq_id: int, vocab_size: int) -> tuple[bool, float]:
    """Whether the rows of one pass equal those of two smaller passes, and the largest difference.
    ``seq_id`` must be empty; it is empty again after."""
    inputs = probe_inputs(runtime, vocab_size)
    whole = _rows(runtime, seq_id, inputs, [(0, PROBE_ROWS)])
    split = _rows(runtime, seq_id, inputs, [(0, SPLIT_AT), (SPLIT_AT, PROBE_ROWS)])
    if whole.shape != split.shape:
        return False, float("inf")
    difference = float(np.max(np.abs(whole - split)))
    return bool(np.array_equal(whole, split)), difference


def _rows(
    runtime: ProbedRuntime, seq_id: int, inputs: np.ndarray, spans: Sequence[tuple[int, int]]
) -> np.ndarray:
    outputs = []
    try:
        for first, end in spans:
            last = end == len(inputs)
            want_logits = last and not runtime.captures
            hidden = runtime.run(
                seq_id,
                first,
                inputs[first:end],
                want_logits=want_logits,
                logit_rows=LOGIT_ROWS if want_logits else 1,
            )
            if hidden is not None:
                outputs.append(np.array(hidden, copy=True))
        if not runtime.captures:
            outputs.append(np.array(runtime.logit_rows(LOGIT_ROWS), copy=True))
    finally:
        runtime.truncate(seq_id, 0)
    return np.concatenate(outputs)


__all__ = ["PROBE_ROWS", "SPLIT_AT", "ProbedRuntime", "prefill_passes_round_alike", "probe_inputs"]
