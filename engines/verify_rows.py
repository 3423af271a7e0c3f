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
  for a single query row once the KV view spans 512 cells (``use_split_kv_path``), and
  llama.cpp pads a sequence's view to 256 cells: so a decode at position 256 or later sums its
  attention in per-thread parts, which no multi-row pass does (0.6 to 6 off).
- Rows below those limits were bit-exact in every case measured (2 to 7 rows, positions 0 to
  255, flash attention on and off).

So a verify step runs its positions below ``SPLIT_KV_FROM_POSITION`` in passes of at most
``ROW_INVARIANT_MAX_ROWS`` rows and the rest one token at a time. An engine checks the claim
on its first multi-row pass against one-token decodes and falls back to one row at a time
for good if the two differ (another build, CPU or backend), so the limits can only cost
speed, never change text.
"""

from __future__ import annotations

# Matrix products of this many rows or fewer skip ggml's tiled k-quant kernel (it starts at 8).
ROW_INVARIANT_MAX_ROWS = 7
# A one-token decode at this position or later attends through the split-KV path.
SPLIT_KV_FROM_POSITION = 256


def verify_passes(first_position: int, n_tokens: int, max_rows: int) -> list[tuple[int, int]]:
    """The passes ``(offset, count)`` that compute a verify step's ``n_tokens`` positions from
    ``first_position``, in order: up to ``max_rows`` together below ``SPLIT_KV_FROM_POSITION``,
    one at a time from there on."""
    passes: list[tuple[int, int]] = []
    offset = 0
    together = max(0, min(n_tokens, SPLIT_KV_FROM_POSITION - first_position))
    while offset < together:
        count = min(max(1, max_rows), together - offset)
        passes.append((offset, count))
        offset += count
    passes += [(rest, 1) for rest in range(offset, n_tokens)]
    return passes


__all__ = ["ROW_INVARIANT_MAX_ROWS", "SPLIT_KV_FROM_POSITION", "verify_passes"]
