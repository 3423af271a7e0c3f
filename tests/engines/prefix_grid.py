"""Prefills on the head's grid through a chain of shard engines, as the head drives them with the
prefix cache on: every chunk is [kC, (k+1)C) (the last one may be partial), a whole block carries
the digest of every token up to its end, and a session may start from a kept prefix by naming its
digest at its first position. Shared by the prefix-cache tests on the tiny model and on Gemma."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engines.engine_chain import chain_step
from engines.interface import GREEDY, SessionKey, ShardEngine, StepRequest, StepResult
from engines.llama_engine import LlamaShardEngine
from meshnode.wire.chunking import plan_prefill_chunks


def block_digests(tokens: Sequence[int], grid: int) -> list[bytes]:
    """The digest of every whole block of ``tokens``: block k's chains block k-1's with its own
    tokens, so it names every token before the block's end (16 bytes, as the head's are)."""
    digests: list[bytes] = []
    previous = b""
    for end in range(grid, len(tokens) + 1, grid):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(np.asarray(tokens[end - grid : end], dtype="<i4").tobytes())
        previous = digest.digest()
        digests.append(previous)
    return digests


def prefix_digest(tokens: Sequence[int], grid: int, length: int) -> bytes:
    """The digest of ``tokens[:length]``: a whole block's on the grid, else the last whole block's
    chained with the tokens after it (a partial block, kept where a pass of 8 rows or more ended)."""
    whole = length // grid * grid
    previous = block_digests(tokens[:whole], grid)[-1] if whole else b""
    if whole == length:
        return previous
    digest = hashlib.blake2b(previous, digest_size=16, person=b"partial-block")
    digest.update(np.asarray(tokens[whole:length], dtype="<i4").tobytes())
    return digest.digest()


@dataclass
class GridRun:
    """What a chain computed: each non-tail engine's hidden rows for the prefilled positions, and
    the tail's logits and greedy token after the prefill and after every decode."""

    hidden: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def prefill_chunk(
    engines: Sequence[ShardEngine],
    key: SessionKey,
    tokens: Sequence[int],
    first: int,
    end: int,
    *,
    block: bytes = b"",
    prefix: bytes = b"",
) -> tuple[list[np.ndarray], StepResult]:
    """``tokens[first:end]`` as one prefill pass at every engine in turn (the tail samples when
    ``end`` is the prompt's end): each non-tail engine's hidden rows, and the tail's result."""
    last_chunk = end == len(tokens)
    rows: list[np.ndarray] = []
    hidden = None
    result: StepResult | None = None
    for index, engine in enumerate(engines):
        tail = index == len(engines) - 1
        result = engine.prefill(
            StepRequest(
                key,
                first,
                token_ids=tuple(tokens[first:end]) if index == 0 else None,
                hidden=hidden,
                sampling=GREEDY if tail and last_chunk else None,
                want_logits=tail and last_chunk,
                block_digest=block,
                prefix_digest=prefix,
            )
        )
        if not tail:
            assert result.hidden is not None
            rows.append(result.hidden)
        hidden = result.hidden
    assert result is not None
    return rows, result


def run_on_grid(
    engines: Sequence[ShardEngine],
    key: SessionKey,
    tokens: Sequence[int],
    grid: int,
    *,
    start: int = 0,
    keep_blocks: bool = True,
    decode_steps: int = 0,
    partial_rows: int = 0,
) -> GridRun:
    """Prefill ``tokens[start:]`` through ``engines`` in grid chunks, then ``decode_steps`` greedy
    decodes. ``start`` > 0 starts the session from the kept prefix of ``start`` tokens (a multiple
    of ``grid``, or with ``partial_rows`` anywhere: the first chunk runs to the next grid point,
    merged into the next chunk or grown to ``partial_rows`` when shorter, as the head's are);
    ``keep_blocks`` False sends no block digests (the session keeps nothing); ``partial_rows`` > 0
    gives a chunk of that many rows or more that is not a whole block its digest too, as the head
    does on a route whose hops keep partial blocks."""
    assert (partial_rows or start % grid == 0) and start < len(tokens)
    rows: list[list[np.ndarray]] = [[] for _ in engines[:-1]]
    run = GridRun()
    chunks = plan_prefill_chunks(
        len(tokens) - start,
        first_position=start,
        max_prefill_chunk_tokens=grid,
        grid=grid,
        min_rows=partial_rows,
    )
    for chunk in chunks:
        first, end = chunk.first_position, chunk.end_position
        whole = end - first == grid
        kept = whole or (partial_rows and end - first >= partial_rows)
        block = prefix_digest(tokens, grid, end) if keep_blocks and kept else b""
        prefix = prefix_digest(tokens, grid, start) if first == start and start else b""
        hop_rows, result = prefill_chunk(engines, key, tokens, first, end, block=block, prefix=prefix)
        for index, hidden in enumerate(hop_rows):
            rows[index].append(hidden)
    assert result.logits is not None and result.token_id is not None
    run.hidden = [np.concatenate(chunks) for chunks in rows]
    run.logits.append(result.logits.copy())
    run.tokens.append(result.token_id)
    position = len(tokens)
    for _ in range(decode_steps):
        result = chain_step(engines, key, position, (run.tokens[-1],))
        assert result.logits is not None and result.token_id is not None
        run.logits.append(result.logits.copy())
        run.tokens.append(result.token_id)
        position += 1
    return run


def release(engines: Sequence[ShardEngine], key: SessionKey) -> None:
    for engine in engines:
        engine.release(key)


def max_logit_difference(got: GridRun, expected: GridRun) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(got.logits, expected.logits, strict=True))


def assert_same_run(got: GridRun, expected: GridRun, *, first_position: int = 0) -> float:
    """``got`` (which prefilled from ``first_position``) computed bit for bit what ``expected``
    did from 0: the same hidden rows at every engine, the same logits and tokens. Returns the
    largest logit difference (0.0)."""
    assert len(got.hidden) == len(expected.hidden)
    for rows, reference in zip(got.hidden, expected.hidden, strict=True):
        assert np.array_equal(rows, reference[first_position:])
    worst = max_logit_difference(got, expected)
    assert worst == 0.0
    assert got.tokens == expected.tokens
    return worst


def kept_lengths(engine: LlamaShardEngine) -> dict[int, int]:
    """What each kept prefix's slot holds in the llama.cpp runtime, by slot: the engine's own
    storage, which the session table only describes."""
    table, runtime = engine._table, engine._main
    assert table is not None and runtime is not None
    return {kept.slot: runtime.cached_length(kept.slot) for kept in table.kept()}


__all__ = [
    "GridRun",
    "assert_same_run",
    "block_digests",
    "kept_lengths",
    "max_logit_difference",
    "prefill_chunk",
    "prefix_digest",
    "release",
    "run_on_grid",
]
