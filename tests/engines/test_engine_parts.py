"""Unit tests of the engines' pure parts: sampling and the session table."""

from __future__ import annotations

import numpy as np
import pytest
from engine_contract import raises_kind

from engines.interface import EngineErrorKind, SamplingParams, SessionKey
from engines.sampling import sample_token, validate_sampling
from engines.session_table import SessionTable

LOGITS = np.random.default_rng(0).standard_normal(1000).astype(np.float32)


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    best = int(np.argmax(LOGITS))
    assert sample_token(LOGITS, SamplingParams()) == best
    assert sample_token(LOGITS, SamplingParams(temperature=5.0, top_k=1, seed=3)) == best
    assert sample_token(LOGITS, SamplingParams(temperature=5.0, top_p=1e-9, seed=3)) == best


def test_seeded_draws_depend_only_on_seed_and_index() -> None:
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42)
    draws = [sample_token(LOGITS, params, i) for i in range(50)]
    assert draws == [sample_token(LOGITS, params, i) for i in range(50)]
    assert len(set(draws)) > 5, "different indices draw different tokens"
    other_seed = [sample_token(LOGITS, SamplingParams(1.0, 50, 0.9, seed=43), i) for i in range(50)]
    assert draws != other_seed
    top50 = set(np.argsort(-LOGITS)[:50].tolist())
    assert set(draws) <= top50


def test_draws_follow_the_softmax() -> None:
    logits = np.array([0.0, np.log(3.0)], dtype=np.float32)
    draws = [sample_token(logits, SamplingParams(temperature=1.0, seed=9), i) for i in range(4000)]
    assert 0.72 < np.mean(draws) < 0.78


def test_invalid_sampling_parameters() -> None:
    for params in (
        SamplingParams(temperature=-0.1),
        SamplingParams(top_k=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(temperature=float("nan")),
    ):
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            validate_sampling(params)


A1, A2, B1 = SessionKey("a", 1), SessionKey("a", 2), SessionKey("b", 1)


def test_slots_are_reused_and_the_least_recently_used_is_displaced() -> None:
    table = SessionTable(capacity=2, ttl_s=10)
    a, displaced = table.open(A1, 0, now=0)
    b, _ = table.open(B1, 0, now=1)
    assert (a.slot, b.slot, displaced) == (0, 1, [])
    table.touch(a, now=2)
    c, displaced = table.open(SessionKey("c", 1), 0, now=3)
    assert [s.key for s in displaced] == [B1] and c.slot == 1
    reopened, displaced = table.open(A1, 0, now=4)
    assert [s.key for s in displaced] == [A1] and reopened.past_len == 0 and len(table) == 2


def test_epochs_displace_older_states_and_refuse_older_work() -> None:
    table = SessionTable(capacity=4, ttl_s=10)
    table.admit_epoch(A1)
    table.open(A1, 0, now=0)
    assert [s.key for s in table.admit_epoch(A2)] == [A1]
    assert table.lookup(A1) is None
    with raises_kind(EngineErrorKind.EPOCH_STALE):
        table.admit_epoch(A1)
    assert table.admit_epoch(A2) == [] and table.admit_epoch(B1) == []


def test_cancel_leaves_a_tombstone_until_reopened_and_ttl_expires() -> None:
    table = SessionTable(capacity=2, ttl_s=10)
    table.open(A1, 0, now=0)
    assert table.cancel(A1) is not None and table.is_cancelled(A1) and table.lookup(A1) is None
    table.open(A1, 0, now=1)
    assert not table.is_cancelled(A1)
    table.open(B1, 3, now=5)
    assert [s.key for s in table.expire(now=11.5)] == [A1]
    assert [s.key for s in table.remove_where_start(3)] == [B1] and len(table) == 0


def test_remembered_epochs_and_cancellations_are_bounded() -> None:
    table = SessionTable(capacity=1, ttl_s=10, memory=3)
    for i in range(10):
        table.admit_epoch(SessionKey(f"s{i}", 5))
        table.cancel(SessionKey(f"s{i}", 5))
    assert not table.is_cancelled(SessionKey("s0", 5)) and table.is_cancelled(SessionKey("s9", 5))
    table.admit_epoch(SessionKey("s0", 1))  # forgotten, so no longer known to be stale


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError):
        SessionTable(capacity=capacity, ttl_s=1)
