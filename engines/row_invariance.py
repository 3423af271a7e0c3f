"""Which rows llama.cpp can compute in one pass and still round each exactly as it rounds that
row alone: a session decoding in a batch gets what it would get alone, and a verify step
(speculative decoding) what plain decoding computes, bit for bit.

Several rows in one ``llama_decode`` read the weights once, so batching sessions and verifying
k drafts cost far less than one pass per row; but only where every row comes out as it would
alone. In the pinned llama.cpp CPU backend, measured on Gemma 3 270M against one-token decodes
and traced to ggml-cpu's sources:

- ``ggml_compute_forward_mul_mat_tiled`` (ggml-cpu/tiled) takes k-quant matrix products of
  ``>= 8`` rows and accumulates in another order (every row of a batch of 8 was 0.3 to 3.5
  off on the logits); up to 7 rows run the same per-row dot products as one row. (Forcing the
  tiled kernel for every row count, ``GGML_CPU_TILED_MM_FORCE``, made a lone decode 38%
  slower; turning it off, ``GGML_CPU_TILED_MM=0``, a 256-token prefill 26% slower.)
- ``ggml_compute_forward_flash_attn_ext_f16`` (ggml-cpu/ops.cpp) splits the KV across threads
  for a lone query row once the KV view spans 512 cells (``use_split_kv_path``; llama.cpp pads
  a sequence's view to 256 cells, so from position 256 on), which no multi-row pass does (0.6
  to 6 off) — but only when K and V share a type. ``engines.llama_runtime`` keeps them apart
  on the CPU (K f16, V bf16), and then passes of 2 to 7 rows were bit-exact at every position
  measured (up to 700), for rows of one sequence and for one row of each of several.

The tiled kernel's rows are another matter among themselves: on Gemma 3 270M (CPU, weights as
loaded) every row of a 700-token prefill came out the same whether the prefill ran in passes of
512, 128, 100, 75 or 64 rows, and differed only where a pass had 7 rows or fewer. So a prefix
cache may keep a prefix ending wherever a prefill pass of ``MIN_SIZE_FREE_PASS_ROWS`` or more
ended, not only on its grid (``EngineCapabilities.size_free_prefill``; repacked weights' gemm
takes four rows at a time and a GPU picks its tiles by the pass's size, so neither says so).

So a verify step runs in passes of at most ``ROW_INVARIANT_MAX_ROWS`` positions, and a batch
of sessions' decodes in passes spanning at most that many KV streams (the runtime fills the
gaps between them with a row each). The llama.cpp engine checks each verify pass size on its
first use below and from ``SPLIT_KV_FROM_POSITION`` against one-token decodes and falls back
to one row at a time for good if they differ (another build, CPU or backend); it checks the
first pass of sessions of each span (and band) against each session alone too, and where one
rounds otherwise runs passes spanning fewer streams from then on. A check is a sample, not a
proof (a reordered float sum can round alike on one input and not the next), so the bounds
below come from the kernels' sources and the check guards what was not traced.

- Repacked weights (``weight_repack``): ggml-cpu/repack.cpp's ``forward_mul_mat`` quantizes
  the activations four rows interleaved and multiplies them with ``gemm`` once a chunk has more
  than three rows, else row by row with ``gemv``, as a lone decode does. On an AMD EPYC
  (AVX-512, no AMX) passes of four rows were 1e-4 to 52 off on the hidden rows, one of the
  checks sampled them equal, and one of four concurrent streams through a mesh changed its
  greedy text; passes of up to three were equal every time. So ``REPACKED_MAX_ROWS``.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prefill passes of this many rows or more round each row alike whatever their size: those the
# tiled kernel takes (the contract's constant, engines.interface).
from engines.interface import MIN_SIZE_FREE_PASS_ROWS

# Matrix products of this many rows or fewer skip ggml's tiled k-quant kernel (it starts at 8).
ROW_INVARIANT_MAX_ROWS = MIN_SIZE_FREE_PASS_ROWS - 1
# With repacked weights, products of this many rows or fewer take the one-row gemv path (gemm from 4).
REPACKED_MAX_ROWS = 3
# From this position a lone decode would attend through the split-KV path if K and V shared a type.
SPLIT_KV_FROM_POSITION = 256


def verify_passes(n_tokens: int, max_rows: int) -> list[tuple[int, int]]:
    """The passes ``(offset, count)`` that compute a verify step's ``n_tokens`` positions, in
    order, up to ``max_rows`` (at least 1) each."""
    rows = max(1, max_rows)
    return [(offset, min(rows, n_tokens - offset)) for offset in range(0, n_tokens, rows)]


def check_band(first_position: int, count: int) -> tuple[int, bool]:
    """What a pass is checked once per: its size, and whether it reaches the split-KV positions."""
    return count, first_position + count > SPLIT_KV_FROM_POSITION


def session_passes(slots: Sequence[int], max_rows: int) -> list[list[int]]:
    """Indices into ``slots`` (distinct KV streams, one decode row each), grouped into passes
    whose streams span at most ``max_rows``, lowest slots first: a pass computes one row per
    stream from its first to its last slot, gaps filled."""
    order = sorted(range(len(slots)), key=lambda index: slots[index])
    passes: list[list[int]] = []
    for index in order:
        if passes and slots[index] - slots[passes[-1][0]] < max(1, max_rows):
            passes[-1].append(index)
        else:
            passes.append([index])
    return passes


__all__ = [
    "MIN_SIZE_FREE_PASS_ROWS",
    "REPACKED_MAX_ROWS",
    "ROW_INVARIANT_MAX_ROWS",
    "SPLIT_KV_FROM_POSITION",
    "check_band",
    "session_passes",
    "verify_passes",
]
