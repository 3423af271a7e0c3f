"""Which positions of a verify step llama.cpp can compute in one pass and still round exactly
as one-token decodes there do (speculative decoding keeps greedy text exact that way).

Several rows of one sequence in one ``llama_decode`` read the weights once, so a verify step
of k positions costs far less than k decodes; but they are only worth it where every row
comes out bit for bit as its own decode would. In the pinned llama.cpp CPU backend, measured
on Gemma 3 270M against one-token decodes, and traced to ggml-cpu's sources:

- ``ggml_compute_forward_mul_mat_tiled`` (ggml-cpu/tiled) takes k-quant matrix products of
  ``>= 8`` rows and accumulates in another order (every row of a batch of 8 was 0.3 to 3.5
  off on the logits); up to 7 rows run the same per-row dot products as one row.
- ``ggml_compute_forward_flash_attn_ext_f16`` (ggml-cpu/ops.cpp) splits the KV across threads
  for a lone query row once the KV view spans 512 cells (``use_split_kv_path``; llama.cpp pads
  a sequence's view to 256 cells, so from position 256 on), which no multi-row pass does (0.6
  to 6 off) — but only when K and V share a type. ``engines.llama_runtime`` keeps them apart
  on the CPU (K f16, V bf16), and then rows of 2 to 7 were bit-exact at every position
  measured (up to 700), as were batches of sessions against the same sessions alone.

So a verify step runs its positions in passes of at most ``ROW_INVARIANT_MAX_ROWS`` rows. An
engine checks each pass size on its first use below and from ``SPLIT_KV_FROM_POSITION``
against one-token decodes, and falls back to one row at a time for good if the two differ
(another build, CPU or backend): the limits can only cost speed, never change text.
"""

from __future__ import annotations

# Matrix products of this many rows or fewer skip ggml's tiled k-quant kernel (it starts at 8).
ROW_INVARIANT_MAX_ROWS = 7
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


__all__ = ["ROW_INVARIANT_MAX_ROWS", "SPLIT_KV_FROM_POSITION", "check_band", "verify_passes"]
