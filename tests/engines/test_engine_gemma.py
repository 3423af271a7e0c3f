"""Acceptance on the real Gemma 3 270M Q4_K_M: split chains are bit-exact against the whole
model on a 100+-token prefill and 20 greedy decode steps, and sessions do not interfere."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engines.engine_chain import chain_step
from engines.interface import LoadRequest, SessionKey, StepResult
from engines.llama_engine import LlamaShardEngine
from engines.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

DECODE_STEPS = 20
PROMPT = (
    "Pooling machines to run one language model works like a relay race: every node holds a contiguous "
    "range of the transformer's layers, receives the hidden state from the node before it, applies its "
    "layers, and hands the result on. Only the last node turns the final hidden state into a probability "
    "for every token of the vocabulary and picks the next word. Explain in two sentences why the split "
    "must not change a single bit of the answer, and what happens to the cache when a node fails and "
    "another node has to take over its layers in the middle of a long answer."
)


def _load(path: Path, start: int = 0, end: int | None = None) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(path), start, end, n_ctx=1024, n_seq_max=2, n_batch=256, n_threads=2))
    return engine


def _generate(
    chain: list[LlamaShardEngine],
    key: SessionKey,
    prompt: tuple[int, ...],
    steps: int,
    start: int | None = None,
) -> Iterator[StepResult]:
    result = chain_step(chain, key, 0, prompt, effective_start_layer=start)
    yield result
    for step in range(steps):
        result = chain_step(chain, key, len(prompt) + step, (result.token_id,), effective_start_layer=start)
        yield result


@pytest.fixture(scope="module")
def tokenizer(gemma_model: Path) -> Iterator[Tokenizer]:
    with Tokenizer.open(gemma_model) as opened:
        yield opened


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> tuple[int, ...]:
    tokens = tuple(tokenizer.tokenize(PROMPT))
    assert len(tokens) >= 100
    return tokens


@pytest.fixture(scope="module")
def reference(gemma_model: Path, prompt: tuple[int, ...]) -> list[StepResult]:
    whole = _load(gemma_model)
    results = list(_generate([whole], SessionKey("ref", 1), prompt, DECODE_STEPS))
    whole.close()
    return results


def _assert_identical(got: list[StepResult], expected: list[StepResult], tokenizer: Tokenizer) -> None:
    assert len(got) == len(expected) == DECODE_STEPS + 1
    worst = max(float(np.abs(a.logits - b.logits).max()) for a, b in zip(got, expected, strict=True))
    assert worst == 0.0
    tokens, expected_tokens = [r.token_id for r in got], [r.token_id for r in expected]
    assert tokens == expected_tokens
    assert tokenizer.detokenize(tokens) == tokenizer.detokenize(expected_tokens)


@pytest.mark.parametrize("splits", [(6,), (9,), (5, 11)], ids=["split-6", "split-9", "three-way-5-11"])
def test_split_chain_is_bit_exact(
    gemma_model: Path,
    tokenizer: Tokenizer,
    prompt: tuple[int, ...],
    reference: list[StepResult],
    splits: tuple[int, ...],
) -> None:
    bounds = [0, *splits, None]
    chain = [_load(gemma_model, start, end) for start, end in itertools.pairwise(bounds)]
    fingerprints = {engine.capabilities().fingerprint for engine in chain}
    try:
        _assert_identical(
            list(_generate(chain, SessionKey("chain", 1), prompt, DECODE_STEPS)), reference, tokenizer
        )
        assert len(fingerprints) == 1
    finally:
        for engine in chain:
            engine.close()


def test_overlapping_ranges_and_interleaved_sessions(
    gemma_model: Path, tokenizer: Tokenizer, prompt: tuple[int, ...], reference: list[StepResult]
) -> None:
    """A [0, 9) head feeding a [6, 18) tail told to start at 9 equals the whole model, and a second
    session decoded in between on the same engines changes nothing for either."""
    chain = [_load(gemma_model, 0, 9), _load(gemma_model, 6)]
    other_prompt = tuple(tokenizer.tokenize("The capital of France is"))
    try:
        other_alone = list(_generate(chain, SessionKey("other", 1), other_prompt, 10, start=9))
        for engine in chain:
            engine.release(SessionKey("other", 1))
        main = _generate(chain, SessionKey("main", 1), prompt, DECODE_STEPS, start=9)
        other = _generate(chain, SessionKey("other", 1), other_prompt, 10, start=9)
        got_main, got_other = [], []
        for index in range(DECODE_STEPS + 1):
            got_main.append(next(main))
            if index <= 10:
                got_other.append(next(other))
        _assert_identical(got_main, reference, tokenizer)
        assert all(np.array_equal(a.logits, b.logits) for a, b in zip(got_other, other_alone, strict=True))
    finally:
        for engine in chain:
            engine.close()
