"""engines.engine_chain: a step through engines chained in one process is what the whole range
computes, and the chain asks the tail only for what the caller wants."""

from __future__ import annotations

import numpy as np
import pytest

from engines.engine_chain import chain_step, greedy_chain
from engines.fake import FakeEngine, FakeModelSpec
from engines.interface import LoadRequest, SessionKey

SPEC = FakeModelSpec(total_layers=6, hidden_size=8, vocab_size=32, seed=5)
PROMPT = (3, 9, 4, 1)


def _loaded(start: int = 0, end: int | None = None) -> FakeEngine:
    engine = FakeEngine(SPEC)
    engine.load(LoadRequest("fake", start, end, n_ctx=64, n_seq_max=1))
    return engine


def test_a_three_way_chain_computes_what_the_whole_range_does():
    whole_logits, whole_tokens = greedy_chain([_loaded()], PROMPT, decode_steps=5)
    split_logits, split_tokens = greedy_chain(
        [_loaded(0, 2), _loaded(2, 5), _loaded(5)], PROMPT, decode_steps=5
    )
    assert split_tokens == whole_tokens
    for got, expected in zip(split_logits, whole_logits, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_logits_come_back_only_when_wanted():
    chain = [_loaded(0, 3), _loaded(3)]
    result = chain_step(chain, SessionKey("quiet", 1), 0, PROMPT, want_logits=False)
    assert result.token_id is not None and result.logits is None


def test_an_empty_chain_is_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        chain_step([], SessionKey("none", 1), 0, PROMPT)
