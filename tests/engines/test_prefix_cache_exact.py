"""Acceptance of the prefix cache on the real Gemma 3 270M Q4_K_M: a session that starts from a
kept prefix computes bit for bit what a fresh prefill of its whole prompt on the same grid does
(the same hidden rows at every hop, the same logits, then 20 identical greedy decodes), for the
whole model and for a split into 0:6 / 6:12 / 12:18, with prefixes past Gemma's sliding window of
512 positions, both by adopting a kept prefix and by copying one that must stay. And the control
that makes the rule necessary: positions written by decode steps are not what a prefill chunk
writes there, so only whole prefill blocks may be kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prefix_grid import GridRun, assert_same_run, kept_lengths, prefill_chunk, release, run_on_grid

from engines.engine_chain import chain_step
from engines.interface import (
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_TOKENS_REUSED,
    LoadRequest,
    SessionKey,
)
from engines.llama_engine import LlamaShardEngine
from engines.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

# The head's prefill grid; no larger than n_batch, so the runtime never splits a chunk again.
GRID = 128
DECODE_STEPS = 20
# The first conversation: five whole blocks (640 positions, past the sliding window) and a partial one.
FIRST_PROMPT_TOKENS = 700
ANSWER_TOKENS = 8
SPLIT = ((0, 6), (6, 12), (12, 18))


def _sentences(topic: str, count: int) -> str:
    return " ".join(
        f"{topic} {i}: node {i} of the mesh holds layers {i % 18} to {i % 18 + 3}, answers within "
        f"{10 + 7 * i} milliseconds and hands its hidden state to node {i + 1}."
        for i in range(count)
    )


def _load(path: Path, start: int = 0, end: int | None = None) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(
            str(path),
            start,
            end,
            n_ctx=2048,
            n_seq_max=3,
            n_batch=512,
            n_threads=2,
            prefix_cache_entries=4,
        )
    )
    return engine


@pytest.fixture(scope="module")
def tokenizer(gemma_model: Path) -> Iterator[Tokenizer]:
    with Tokenizer.open(gemma_model) as opened:
        yield opened


@pytest.fixture(scope="module")
def texts(tokenizer: Tokenizer) -> dict[str, tuple[int, ...]]:
    """The first turn and three continuations, cut to fixed token counts."""
    lengths = {"first": FIRST_PROMPT_TOKENS, "second": 230, "branch": 120, "third": 100}
    tokens = {}
    for name, length in lengths.items():
        tokens[name] = tuple(tokenizer.tokenize(_sentences(name.capitalize(), 60)))[:length]
        assert len(tokens[name]) == length
    return tokens


@pytest.fixture(scope="module")
def whole(gemma_model: Path) -> Iterator[list[LlamaShardEngine]]:
    engine = _load(gemma_model)
    yield [engine]
    engine.close()


@pytest.fixture(scope="module")
def split(gemma_model: Path) -> Iterator[list[LlamaShardEngine]]:
    engines = [_load(gemma_model, start, end) for start, end in SPLIT]
    assert engines[-1].capabilities().layer_end == 18
    yield engines
    for engine in engines:
        engine.close()


def _fresh(chain: list[LlamaShardEngine], name: str, prompt: tuple[int, ...]) -> GridRun:
    """The reference: the whole prompt prefilled from 0 on the grid by a session that keeps nothing."""
    key = SessionKey(f"{name}-fresh", 1)
    run = run_on_grid(chain, key, prompt, GRID, keep_blocks=False, decode_steps=DECODE_STEPS)
    release(chain, key)
    return run


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_a_conversation_continues_from_kept_prefixes_exactly(
    layout: str, texts: dict[str, tuple[int, ...]], request: pytest.FixtureRequest
) -> None:
    chain: list[LlamaShardEngine] = request.getfixturevalue(layout)
    hits = [engine.metrics()[METRIC_PREFIX_HITS] for engine in chain]
    reused = [engine.metrics()[METRIC_PREFIX_TOKENS_REUSED] for engine in chain]

    # Turn one: 700 tokens on the grid, a short answer, then released: 5 whole blocks stay kept.
    first_key = SessionKey(f"{layout}-first", 1)
    first = run_on_grid(chain, first_key, texts["first"], GRID, decode_steps=ANSWER_TOKENS - 1)
    release(chain, first_key)
    assert [list(kept_lengths(engine).values()) for engine in chain] == [[640]] * len(chain)

    # Turn two resends turn one and its answer: it adopts the kept slot and prefills from 640.
    second_prompt = texts["first"] + tuple(first.tokens) + texts["second"]
    assert len(second_prompt) == 938
    expected = _fresh(chain, f"{layout}-second", second_prompt)
    second_key = SessionKey(f"{layout}-second", 1)
    second = run_on_grid(chain, second_key, second_prompt, GRID, start=640, decode_steps=DECODE_STEPS)
    worst = assert_same_run(second, expected, first_position=640)
    print(f"\n{layout}: adopted 640 kept positions, max |Δlogit| over 21 steps = {worst}")
    release(chain, second_key)
    # Turn two kept its 7 whole blocks in the slot it adopted.
    assert [list(kept_lengths(engine).values()) for engine in chain] == [[896]] * len(chain)

    # A branch from turn two's first 768 positions: the longer prefix must stay, so it is copied.
    branch_prompt = second_prompt[:768] + texts["branch"]
    expected = _fresh(chain, f"{layout}-branch", branch_prompt)
    before = [kept_lengths(engine) for engine in chain]
    branch_key = SessionKey(f"{layout}-branch", 1)
    branch = run_on_grid(chain, branch_key, branch_prompt, GRID, start=768, decode_steps=DECODE_STEPS)
    worst = assert_same_run(branch, expected, first_position=768)
    print(f"{layout}: copied 768 of 896 kept positions, max |Δlogit| = {worst}")
    # The kept prefix is intact, in its own slot: the copy went elsewhere.
    assert [kept_lengths(engine) for engine in chain] == before
    for engine, kept in zip(chain, before, strict=True):
        held = engine._table.lookup(branch_key) if engine._table is not None else None
        assert held is not None and held.slot not in kept

    # A third session starts from the whole longer prefix (adopting it): exact too.
    third_prompt = second_prompt[:896] + texts["third"]
    expected = _fresh(chain, f"{layout}-third", third_prompt)
    third_key = SessionKey(f"{layout}-third", 1)
    third = run_on_grid(chain, third_key, third_prompt, GRID, start=896, decode_steps=DECODE_STEPS)
    worst = assert_same_run(third, expected, first_position=896)
    print(f"{layout}: adopted the intact 896-position prefix, max |Δlogit| = {worst}")
    release(chain, branch_key)
    release(chain, third_key)

    assert [engine.metrics()[METRIC_PREFIX_HITS] - h for engine, h in zip(chain, hits, strict=True)] == [
        3
    ] * len(chain)
    assert [
        engine.metrics()[METRIC_PREFIX_TOKENS_REUSED] - r for engine, r in zip(chain, reused, strict=True)
    ] == [640 + 768 + 896] * len(chain)


def test_positions_written_by_decode_steps_differ_from_prefilled_ones(
    whole: list[LlamaShardEngine], texts: dict[str, tuple[int, ...]]
) -> None:
    """Positions 640-699 written one token a pass (as an answer is) against the same tokens in one
    prefill chunk: the next step, the same one-token decode at 700, sees other logits. So a kept
    prefix may hold prefill blocks only."""
    prompt = texts["first"]
    prefilled_key = SessionKey("control-prefilled", 1)
    prefilled = run_on_grid(whole, prefilled_key, prompt, GRID, keep_blocks=False, decode_steps=1)
    release(whole, prefilled_key)

    decoded_key = SessionKey("control-decoded", 1)
    run_on_grid(whole, decoded_key, prompt[:640], GRID, keep_blocks=False)
    for position in range(640, len(prompt)):
        chain_step(whole, decoded_key, position, (prompt[position],))
    result = chain_step(whole, decoded_key, len(prompt), (prefilled.tokens[0],))
    release(whole, decoded_key)
    assert result.logits is not None

    worst = float(np.abs(result.logits - prefilled.logits[1]).max())
    print(f"\ncontrol: decode-written positions 640-699, max |Δlogit| at the next decode = {worst}")
    assert worst > 0.0


# The fewest rows of a pass whose rows round alike whatever its size (engines.row_invariance).
PARTIAL_ROWS = 8


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_a_prefix_kept_off_the_grid_continues_exactly(
    layout: str, texts: dict[str, tuple[int, ...]], request: pytest.FixtureRequest
) -> None:
    """Where every hop rounds a prefill row alike in any pass of 8 rows or more, the prompt's
    partial last block is kept too: the next turn starts after all 700 positions (its first chunk
    runs 700 to 768, where the fresh prefill's runs 640 to 768) and computes bit for bit what a
    fresh prefill does, the previous answer prefilled again."""
    chain: list[LlamaShardEngine] = request.getfixturevalue(layout)
    assert all(engine.capabilities().size_free_prefill for engine in chain)
    first_key = SessionKey(f"{layout}-partial-first", 1)
    first = run_on_grid(
        chain, first_key, texts["first"], GRID, decode_steps=ANSWER_TOKENS - 1, partial_rows=PARTIAL_ROWS
    )
    release(chain, first_key)
    assert all(700 in kept_lengths(engine).values() for engine in chain)

    second_prompt = texts["first"] + tuple(first.tokens) + texts["second"]
    expected = _fresh(chain, f"{layout}-partial-second", second_prompt)
    second_key = SessionKey(f"{layout}-partial-second", 1)
    second = run_on_grid(
        chain,
        second_key,
        second_prompt,
        GRID,
        start=700,
        decode_steps=DECODE_STEPS,
        partial_rows=PARTIAL_ROWS,
    )
    worst = assert_same_run(second, expected, first_position=700)
    print(f"\n{layout}: adopted 700 kept positions (a partial block of 60), max |Δlogit| = {worst}")
    release(chain, second_key)
    # It kept its own prompt whole: 938 positions, 58 past its last whole block.
    assert all(938 in kept_lengths(engine).values() for engine in chain)

    # A prefix kept 4 positions short of a grid point (764): the next prompt's first chunk grows to
    # 8 rows (764 to 772, then 772 to 896), where the fresh prefill has 640 to 768 and 768 to 896.
    near_key = SessionKey(f"{layout}-partial-near", 1)
    run_on_grid(chain, near_key, second_prompt[:764], GRID, start=700, partial_rows=PARTIAL_ROWS)
    release(chain, near_key)
    assert all(764 in kept_lengths(engine).values() for engine in chain)
    near_prompt = second_prompt[:764] + texts["second"]
    expected = _fresh(chain, f"{layout}-partial-grown", near_prompt)
    grown_key = SessionKey(f"{layout}-partial-grown", 1)
    grown = run_on_grid(
        chain, grown_key, near_prompt, GRID, start=764, decode_steps=DECODE_STEPS, partial_rows=PARTIAL_ROWS
    )
    worst = assert_same_run(grown, expected, first_position=764)
    print(f"{layout}: from 764 kept positions, a first chunk grown to 8 rows, max |Δlogit| = {worst}")
    release(chain, grown_key)
    for engine in chain:
        engine.clear_prefix_cache()


def test_a_partial_block_of_fewer_than_eight_rows_would_differ(
    split: list[LlamaShardEngine], texts: dict[str, tuple[int, ...]]
) -> None:
    """The control for the 8-row floor: positions 640-643 prefilled as a pass of 4 rows, against
    the same tokens in the fresh prefill's pass of 128 rows: what the first hop computes for them
    (its KV, and the rows the next hop builds its own from) differs, so such a block is never kept
    (the head sends it no digest); the same positions in a pass of 8 rows or more do not differ."""
    prompt = texts["first"][:644] + texts["second"][:100]
    expected = _fresh(split, "control-partial", prompt)
    for small, name in ((4, "small"), (PARTIAL_ROWS, "floor")):
        key = SessionKey(f"control-partial-{name}", 1)
        spans = [*((first, first + GRID) for first in range(0, 640, GRID)), (640, 640 + small)]
        spans.append((640 + small, 744))
        rows = [prefill_chunk(split, key, prompt, first, end)[0][0] for first, end in spans]
        release(split, key)
        first_hop = np.concatenate(rows)
        differing = np.flatnonzero(np.any(first_hop != expected.hidden[0], axis=1))
        print(f"\ncontrol: a {small}-row pass at 640, first hop rows differing: {differing.tolist()}")
        if small < PARTIAL_ROWS:
            assert differing.tolist() == list(range(640, 640 + small))
        else:
            assert differing.size == 0
