"""Prefill chunk planning: token-aligned chunks with a bounded token count.

A long prompt is split before the first forward pass so that the activation
crossing each boundary stays bounded whatever the prompt length. A split never
falls mid-token; when the per-token activation size is known the bound also
keeps each chunk's bundle under the negotiated ``max_chunk_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_PREFILL_CHUNK_TOKENS = 128
# Room for the envelope, tensor header and protobuf tags around the payload.
CHUNK_OVERHEAD_BYTES = 16 * 1024


@dataclass(frozen=True)
class PrefillChunk:
    index: int
    count: int
    first_position: int
    token_count: int

    @property
    def final(self) -> bool:
        return self.index == self.count - 1

    @property
    def end_position(self) -> int:
        return self.first_position + self.token_count


def tokens_per_chunk(
    max_prefill_chunk_tokens: int = DEFAULT_MAX_PREFILL_CHUNK_TOKENS,
    *,
    bytes_per_token: int | None = None,
    max_chunk_bytes: int | None = None,
) -> int:
    """The largest token count a chunk may carry under both bounds."""
    if max_prefill_chunk_tokens <= 0:
        raise ValueError("max_prefill_chunk_tokens must be positive")
    bound = max_prefill_chunk_tokens
    if bytes_per_token is not None and max_chunk_bytes is not None:
        by_bytes = (max_chunk_bytes - CHUNK_OVERHEAD_BYTES) // bytes_per_token
        if by_bytes < 1:
            raise ValueError(
                f"one token ({bytes_per_token} bytes) does not fit max_chunk_bytes={max_chunk_bytes}"
            )
        bound = min(bound, by_bytes)
    return bound


def plan_prefill_chunks(
    n_tokens: int,
    *,
    first_position: int = 0,
    max_prefill_chunk_tokens: int = DEFAULT_MAX_PREFILL_CHUNK_TOKENS,
    bytes_per_token: int | None = None,
    max_chunk_bytes: int | None = None,
    grid: int | None = None,
    min_rows: int = 0,
) -> list[PrefillChunk]:
    """Split ``n_tokens`` starting at ``first_position`` into bounded chunks.

    Without a ``grid`` chunks are as even as possible (sizes differ by at most one
    token) so no tail chunk of one token costs a whole extra round trip of latency.
    With one, every boundary falls on a multiple of ``grid`` (absolute positions, at
    most the bound): the same positions are then computed in the same passes by every
    prefill of the same tokens, whatever its length, which is what lets a kept prefix
    stand for a fresh prefill bit for bit (the prefix cache). ``min_rows`` (with a grid): a
    first chunk shorter than that, before the next grid point, is merged into the chunk after it
    where both fit the bound, else grows to ``min_rows`` at that chunk's expense, so a prefill
    resumed just before a grid point computes no position in a pass smaller than the fresh
    prefill's (engines.row_invariance: from 8 rows a pass's size does not change its rows).
    """
    if n_tokens <= 0:
        raise ValueError("a prefill needs at least one token")
    bound = tokens_per_chunk(
        max_prefill_chunk_tokens, bytes_per_token=bytes_per_token, max_chunk_bytes=max_chunk_bytes
    )
    if grid is not None:
        return _grid_chunks(n_tokens, first_position, grid, bound, min_rows)
    count = -(-n_tokens // bound)
    base, extra = divmod(n_tokens, count)
    chunks: list[PrefillChunk] = []
    position = first_position
    for index in range(count):
        size = base + (1 if index < extra else 0)
        chunks.append(PrefillChunk(index=index, count=count, first_position=position, token_count=size))
        position += size
    return chunks


def _grid_chunks(
    n_tokens: int, first_position: int, grid: int, bound: int, min_rows: int = 0
) -> list[PrefillChunk]:
    if not 0 < grid <= bound:
        raise ValueError(f"a prefill grid of {grid} tokens does not fit chunks of at most {bound}")
    end = first_position + n_tokens
    spans = []
    position = first_position
    while position < end:
        stop = min(end, (position // grid + 1) * grid)
        spans.append((position, stop - position))
        position = stop
    if len(spans) > 1 and spans[0][1] < min_rows:
        (first, short), (_, after) = spans[0], spans[1]
        if short + after <= bound:
            spans[:2] = [(first, short + after)]
        else:
            spans[:2] = [(first, min_rows), (first + min_rows, short + after - min_rows)]
    return [
        PrefillChunk(index=index, count=len(spans), first_position=first, token_count=count)
        for index, (first, count) in enumerate(spans)
    ]


__all__ = [
    "CHUNK_OVERHEAD_BYTES",
    "DEFAULT_MAX_PREFILL_CHUNK_TOKENS",
    "PrefillChunk",
    "plan_prefill_chunks",
    "tokens_per_chunk",
]
