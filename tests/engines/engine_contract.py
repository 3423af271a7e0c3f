"""The behaviour every ShardEngine must show, as a reusable test class.

Subclass ``EngineContract`` in a ``Test...`` class and implement ``new_engine`` (an
unloaded engine using the given clock) and ``model_path``; every test below then runs
against that engine. The model must have at least three layers so a head, a middle and a
tail shard exist.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engines.interface import (
    GREEDY,
    METRIC_CACHE_MISSES,
    METRIC_DECODE_STEPS,
    METRIC_PREFILL_STEPS,
    METRIC_SESSIONS_CANCELLED,
    METRIC_SESSIONS_EVICTED,
    METRIC_SESSIONS_EXPIRED,
    METRIC_SESSIONS_OPENED,
    METRIC_SESSIONS_RELEASED,
    METRIC_STEPS_CANCELLED,
    METRIC_TOKENS_PROCESSED,
    CancelToken,
    EngineError,
    EngineErrorKind,
    LoadRequest,
    SamplingParams,
    SessionKey,
    ShardEngine,
    StepRequest,
    StepResult,
)


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CancelAfterPolls(CancelToken):
    """Reads as not cancelled for the first ``polls`` checks, then cancelled: a cancel that
    lands while the step is running, without depending on timing."""

    __slots__ = ("_remaining",)

    def __init__(self, polls: int) -> None:
        super().__init__()
        self._remaining = polls

    @property
    def cancelled(self) -> bool:
        if self._remaining > 0:
            self._remaining -= 1
            return False
        return True


def raises_kind(kind: EngineErrorKind) -> Any:
    """``pytest.raises`` for an EngineError of exactly this kind."""
    return pytest.raises(EngineError, match=f"^{kind.value}:")


def prompt_tokens(n: int, vocab: int, seed: int = 7) -> tuple[int, ...]:
    # Avoid the low ids, which are control tokens in real vocabularies.
    low = min(8, vocab - 1)
    return tuple(int(t) for t in np.random.default_rng(seed).integers(low, vocab, size=n))


class EngineContract:
    n_ctx = 512
    n_seq_max = 2
    ttl_s = 60.0

    # --- what a subclass provides ---

    def new_engine(self, clock: ManualClock) -> ShardEngine:
        raise NotImplementedError

    def model_path(self) -> str:
        raise NotImplementedError

    # --- helpers ---

    @pytest.fixture(autouse=True)
    def _engines(self) -> Iterator[None]:
        self.clock = ManualClock()
        self._opened: list[ShardEngine] = []
        yield
        for engine in self._opened:
            engine.close()

    def engine(self, layer_start: int = 0, layer_end: int | None = None, **overrides: Any) -> ShardEngine:
        engine = self.new_engine(self.clock)
        self._opened.append(engine)
        request = LoadRequest(
            self.model_path(),
            layer_start=layer_start,
            layer_end=layer_end,
            n_ctx=self.n_ctx,
            n_seq_max=self.n_seq_max,
            n_batch=64,
            n_threads=2,
            session_ttl_s=self.ttl_s,
        )
        engine.load(dataclasses.replace(request, **overrides))
        return engine

    def whole(self, **overrides: object) -> ShardEngine:
        return self.engine(0, None, **overrides)

    def shards(self) -> tuple[ShardEngine, ShardEngine, ShardEngine]:
        """Head, middle and tail engines of one model (at least three layers)."""
        total = self.whole().capabilities().total_layers
        first, second = max(1, total // 3), max(2, 2 * total // 3)
        return self.engine(0, first), self.engine(first, second), self.engine(second, None)

    def vocab(self, engine: ShardEngine) -> int:
        return engine.capabilities().vocab_size

    def tail_step(
        self, engine: ShardEngine, key: SessionKey, tokens: tuple[int, ...], position: int = 0
    ) -> StepResult:
        if position == 0:
            return engine.prefill(StepRequest(key, 0, token_ids=tokens, sampling=GREEDY, want_logits=True))
        return engine.decode(
            StepRequest(
                key, position, token_ids=tokens, expected_past_len=position, sampling=GREEDY, want_logits=True
            )
        )

    # --- lifecycle ---

    def test_unloaded_engine_refuses_work_and_reports_unhealthy(self) -> None:
        engine = self.new_engine(self.clock)
        self._opened.append(engine)
        assert engine.health().loaded is False
        with raises_kind(EngineErrorKind.NOT_LOADED):
            engine.capabilities()
        with raises_kind(EngineErrorKind.NOT_LOADED):
            engine.prefill(StepRequest(SessionKey("s", 1), 0, token_ids=(1, 2)))
        assert engine.release(SessionKey("s", 1)) is False
        assert engine.cancel(SessionKey("s", 1)) == 0

    def test_load_reports_range_fingerprint_and_health(self) -> None:
        head, middle, tail = self.shards()
        caps = [e.capabilities() for e in (head, middle, tail)]
        assert [c.is_head for c in caps] == [True, False, False]
        assert [c.is_tail for c in caps] == [False, False, True]
        assert caps[0].layer_end == caps[1].layer_start and caps[1].layer_end == caps[2].layer_start
        assert len({c.fingerprint for c in caps}) == 1, "shards of one model and recipe share a fingerprint"
        fingerprint = caps[0].fingerprint
        assert len(fingerprint.model_artifact_digest) == 64 and len(fingerprint.runtime_recipe_digest) == 64
        assert fingerprint.recipe_id
        assert caps[0].max_sessions == self.n_seq_max and caps[0].max_context_tokens > 0
        health = head.health()
        assert health.loaded and health.active_sessions == 0 and health.kv_tokens_capacity > 0

    def test_loading_twice_is_refused(self) -> None:
        engine = self.whole()
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            engine.load(LoadRequest(self.model_path()))

    def test_layer_range_outside_model_is_refused(self) -> None:
        total = self.whole().capabilities().total_layers
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            self.engine(0, total + 1)
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            self.engine(2, 2)

    # --- inputs and outputs ---

    def test_head_middle_tail_shapes(self) -> None:
        head, middle, tail = self.shards()
        caps = head.capabilities()
        key = SessionKey("shapes", 1)
        tokens = prompt_tokens(12, caps.vocab_size)
        first = head.prefill(StepRequest(key, 0, token_ids=tokens))
        assert first.hidden is not None and first.hidden.dtype == np.float32
        assert first.hidden.shape == (12, caps.hidden_size)
        assert first.token_id is None and first.logits is None
        assert (first.past_len, first.cache_hit) == (12, False)
        second = middle.prefill(StepRequest(key, 0, hidden=first.hidden))
        assert second.hidden is not None and second.hidden.shape == (12, caps.hidden_size)
        last = tail.prefill(StepRequest(key, 0, hidden=second.hidden, sampling=GREEDY, want_logits=True))
        assert last.hidden is None and last.logits is not None and last.logits.shape == (caps.vocab_size,)
        assert last.token_id == int(np.argmax(last.logits))
        quiet = tail.prefill(StepRequest(SessionKey("shapes", 2), 0, hidden=second.hidden))
        assert quiet.token_id is None and quiet.logits is None, "no sampling asked, nothing sampled"

    def test_wrong_inputs_are_invalid_requests(self) -> None:
        head, middle, tail = self.shards()
        caps = head.capabilities()
        key = SessionKey("bad", 1)
        hidden = np.zeros((3, caps.hidden_size), dtype=np.float32)
        cases = [
            (head, StepRequest(key, 0, hidden=hidden)),
            (middle, StepRequest(key, 0, token_ids=(1, 2, 3))),
            (middle, StepRequest(key, 0, hidden=np.zeros((3, caps.hidden_size + 1), dtype=np.float32))),
            (middle, StepRequest(key, 0, hidden=hidden.astype(np.float64))),
            (middle, StepRequest(key, 0, hidden=np.full_like(hidden, np.nan))),
            (head, StepRequest(key, 0, token_ids=(1, caps.vocab_size))),
            (head, StepRequest(key, 0, token_ids=(-1,))),
            (middle, StepRequest(key, 0, hidden=hidden, sampling=GREEDY)),
            (head, StepRequest(key, 0, token_ids=(1,), want_logits=True)),
            (tail, StepRequest(key, 0, hidden=hidden, sampling=SamplingParams(temperature=1.0, top_p=0.0))),
            (tail, StepRequest(key, 0, hidden=hidden, sampling=SamplingParams(temperature=-1.0))),
        ]
        for engine, request in cases:
            with raises_kind(EngineErrorKind.INVALID_REQUEST):
                engine.prefill(request)
        with raises_kind(EngineErrorKind.INVALID_REQUEST):
            head.decode(StepRequest(key, 0, token_ids=(1, 2), expected_past_len=0))
        for engine in (head, middle, tail):
            assert engine.health().active_sessions == 0, "a refused request opens no session"

    def test_context_limit_is_resource_exhausted_and_harmless(self) -> None:
        engine = self.whole()
        limit = engine.capabilities().max_context_tokens
        key = SessionKey("long", 1)
        engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(4, self.vocab(engine))))
        with raises_kind(EngineErrorKind.RESOURCE_EXHAUSTED):
            engine.prefill(StepRequest(key, 4, token_ids=(1,) * limit))
        assert engine.decode(StepRequest(key, 4, token_ids=(5,), expected_past_len=4)).past_len == 5

    # --- determinism and chaining ---

    def test_same_input_gives_identical_output(self) -> None:
        first, second = self.whole(), self.whole()
        tokens = prompt_tokens(20, self.vocab(first))
        a = self.tail_step(first, SessionKey("a", 1), tokens)
        b = self.tail_step(first, SessionKey("b", 1), tokens)
        c = self.tail_step(second, SessionKey("a", 1), tokens)
        assert a.logits is not None and b.logits is not None and c.logits is not None
        assert np.array_equal(a.logits, b.logits) and np.array_equal(a.logits, c.logits)
        assert a.token_id == b.token_id == c.token_id

    def test_chained_shards_equal_whole_model(self) -> None:
        whole = self.whole()
        head, middle, tail = self.shards()
        tokens = prompt_tokens(24, self.vocab(whole))
        key = SessionKey("chain", 1)
        reference = self.tail_step(whole, key, tokens)
        hidden = middle.prefill(
            StepRequest(key, 0, hidden=head.prefill(StepRequest(key, 0, token_ids=tokens)).hidden)
        )
        chained = tail.prefill(StepRequest(key, 0, hidden=hidden.hidden, sampling=GREEDY, want_logits=True))
        assert np.array_equal(chained.logits, reference.logits)
        token, position = reference.token_id, len(tokens)
        for _ in range(4):
            assert token is not None
            expected = self.tail_step(whole, key, (token,), position)
            h = head.decode(StepRequest(key, position, token_ids=(token,), expected_past_len=position)).hidden
            h = middle.decode(StepRequest(key, position, hidden=h, expected_past_len=position)).hidden
            got = tail.decode(
                StepRequest(
                    key, position, hidden=h, expected_past_len=position, sampling=GREEDY, want_logits=True
                )
            )
            assert np.array_equal(got.logits, expected.logits) and got.token_id == expected.token_id
            token, position = expected.token_id, position + 1

    def test_effective_start_layer_skips_layers_already_applied(self) -> None:
        whole = self.whole()
        total = whole.capabilities().total_layers
        split, overlap_start = total // 2 + 1, total // 2 - 1
        head = self.engine(0, split)
        overlapping_tail = self.engine(overlap_start, None)
        tokens = prompt_tokens(16, self.vocab(whole))
        key = SessionKey("overlap", 1)
        reference = self.tail_step(whole, key, tokens)
        hidden = head.prefill(StepRequest(key, 0, token_ids=tokens)).hidden
        got = overlapping_tail.prefill(
            StepRequest(key, 0, hidden=hidden, effective_start_layer=split, sampling=GREEDY, want_logits=True)
        )
        assert np.array_equal(got.logits, reference.logits)
        token = reference.token_id
        assert token is not None
        expected = self.tail_step(whole, key, (token,), len(tokens))
        h = head.decode(
            StepRequest(key, len(tokens), token_ids=(token,), expected_past_len=len(tokens))
        ).hidden
        got = overlapping_tail.decode(
            StepRequest(
                key,
                len(tokens),
                hidden=h,
                expected_past_len=len(tokens),
                effective_start_layer=split,
                sampling=GREEDY,
                want_logits=True,
            )
        )
        assert np.array_equal(got.logits, expected.logits)
        with raises_kind(EngineErrorKind.INVALID_REQUEST):  # the session started at `split`
            overlapping_tail.decode(
                StepRequest(key, len(tokens) + 1, hidden=h, expected_past_len=len(tokens) + 1)
            )
        for outside in (overlap_start - 1, total):
            with raises_kind(EngineErrorKind.INVALID_REQUEST):
                overlapping_tail.prefill(
                    StepRequest(SessionKey("o2", 1), 0, hidden=h, effective_start_layer=outside)
                )

    def test_interleaved_sessions_equal_each_run_alone(self) -> None:
        alone, shared = self.whole(), self.whole()
        vocab = self.vocab(alone)
        prompts = {
            SessionKey("x", 1): prompt_tokens(18, vocab, 1),
            SessionKey("y", 1): prompt_tokens(11, vocab, 2),
        }

        def run(engine: ShardEngine, key: SessionKey, steps: int) -> Iterator[np.ndarray]:
            result = self.tail_step(engine, key, prompts[key])
            yield result.logits
            position = len(prompts[key])
            for _ in range(steps):
                result = self.tail_step(engine, key, (result.token_id,), position)
                position += 1
                yield result.logits

        expected = {key: list(run(alone, key, 5)) for key in prompts}
        for key in prompts:
            alone.release(key)
        runs = {key: run(shared, key, 5) for key in prompts}
        got: dict[SessionKey, list[np.ndarray]] = {key: [] for key in prompts}
        for key in itertools.islice(itertools.cycle(prompts), 12):
            got[key].append(next(runs[key]))
        for key in prompts:
            assert all(np.array_equal(a, b) for a, b in zip(got[key], expected[key], strict=True))

    def test_chunked_prefill_continues_the_session(self) -> None:
        engine = self.whole()
        tokens = prompt_tokens(30, self.vocab(engine))
        key = SessionKey("chunks", 1)
        first = engine.prefill(StepRequest(key, 0, token_ids=tokens[:17]))
        second = engine.prefill(StepRequest(key, 17, token_ids=tokens[17:], sampling=GREEDY))
        assert (first.past_len, first.cache_hit) == (17, False)
        assert (second.past_len, second.cache_hit) == (30, True)
        assert second.token_id is not None

    # --- cache expectations ---

    def test_cache_miss_carries_the_actual_length(self) -> None:
        engine = self.whole()
        key = SessionKey("miss", 1)
        engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(9, self.vocab(engine))))
        for request in (
            StepRequest(key, 7, token_ids=(5,), expected_past_len=7),
            StepRequest(key, 10, token_ids=(5,), expected_past_len=10),
        ):
            with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
                engine.decode(request)
            assert caught.value.actual_past_len == 9
        with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
            engine.prefill(StepRequest(key, 4, token_ids=(5, 6)))
        assert caught.value.actual_past_len == 9
        with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
            engine.decode(StepRequest(SessionKey("never-opened", 1), 3, token_ids=(5,), expected_past_len=3))
        assert caught.value.actual_past_len == 0
        assert engine.decode(StepRequest(key, 9, token_ids=(5,), expected_past_len=9)).past_len == 10
        assert engine.metrics()[METRIC_CACHE_MISSES] == 4

    def test_cache_miss_is_detected_not_computed_statelessly(self) -> None:
        """A decode after a fresh prefill of a different prompt must not equal the original:
        outputs depend on the cached past."""
        engine = self.whole()
        vocab = self.vocab(engine)
        key = SessionKey("past", 1)
        first = self.tail_step(engine, key, prompt_tokens(10, vocab, 3))
        follow_a = self.tail_step(engine, key, (first.token_id,), 10)
        self.tail_step(engine, key, prompt_tokens(10, vocab, 4))
        follow_b = self.tail_step(engine, key, (first.token_id,), 10)
        assert not np.array_equal(follow_a.logits, follow_b.logits)

    # --- epochs ---

    def test_newer_epoch_replaces_and_older_epoch_is_stale(self) -> None:
        engine = self.whole()
        vocab = self.vocab(engine)
        old, new = SessionKey("route", 1), SessionKey("route", 2)
        engine.prefill(StepRequest(old, 0, token_ids=prompt_tokens(5, vocab)))
        engine.prefill(StepRequest(new, 0, token_ids=prompt_tokens(6, vocab)))
        assert engine.health().active_sessions == 1, "the epoch-1 state was dropped"
        with raises_kind(EngineErrorKind.EPOCH_STALE):
            engine.decode(StepRequest(old, 5, token_ids=(5,), expected_past_len=5))
        with raises_kind(EngineErrorKind.EPOCH_STALE):
            engine.prefill(StepRequest(old, 0, token_ids=(5,)))
        assert engine.decode(StepRequest(new, 6, token_ids=(5,), expected_past_len=6)).past_len == 7
        newer = SessionKey("route", 3)
        with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
            engine.decode(StepRequest(newer, 7, token_ids=(5,), expected_past_len=7))
        assert caught.value.actual_past_len == 0
        assert engine.health().active_sessions == 0, "epoch 3 work displaced the epoch-2 state"

    # --- cancellation ---

    def test_cancelled_session_refuses_steps_until_a_fresh_prefill(self) -> None:
        engine = self.whole()
        key = SessionKey("cancel", 1)
        tokens = prompt_tokens(8, self.vocab(engine))
        engine.prefill(StepRequest(key, 0, token_ids=tokens))
        assert engine.cancel(key) == 0, "nothing was running"
        assert engine.health().active_sessions == 0, "cancel frees the cache"
        with raises_kind(EngineErrorKind.CANCELLED):
            engine.decode(StepRequest(key, 8, token_ids=(5,), expected_past_len=8))
        with raises_kind(EngineErrorKind.CANCELLED):
            engine.prefill(StepRequest(key, 8, token_ids=(5, 6)))
        assert engine.prefill(StepRequest(key, 0, token_ids=tokens)).past_len == 8
        assert engine.decode(StepRequest(key, 8, token_ids=(5,), expected_past_len=8)).past_len == 9
        metrics = engine.metrics()
        assert metrics[METRIC_SESSIONS_CANCELLED] == 1 and metrics[METRIC_STEPS_CANCELLED] == 2

    def test_cancel_token_set_before_the_step_leaves_the_cache_alone(self) -> None:
        engine = self.whole()
        key = SessionKey("token", 1)
        engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(6, self.vocab(engine))))
        token = CancelToken()
        token.cancel()
        with raises_kind(EngineErrorKind.CANCELLED):
            engine.decode(StepRequest(key, 6, token_ids=(5,), expected_past_len=6, cancel_token=token))
        assert engine.decode(StepRequest(key, 6, token_ids=(5,), expected_past_len=6)).past_len == 7

    def test_cancel_while_running_rolls_the_cache_back(self) -> None:
        whole, reference = self.whole(), self.whole()
        vocab = self.vocab(whole)
        key = SessionKey("abort", 1)
        prefix, rest = prompt_tokens(10, vocab, 5), prompt_tokens(40, vocab, 6)
        whole.prefill(StepRequest(key, 0, token_ids=prefix))
        with raises_kind(EngineErrorKind.CANCELLED):
            whole.prefill(StepRequest(key, 10, token_ids=rest, cancel_token=CancelAfterPolls(1)))
        assert whole.health().kv_tokens_used == 10, "the abandoned chunk's positions are gone"
        retried = whole.prefill(StepRequest(key, 10, token_ids=rest, sampling=GREEDY, want_logits=True))
        reference.prefill(StepRequest(key, 0, token_ids=prefix))
        expected = reference.prefill(StepRequest(key, 10, token_ids=rest, sampling=GREEDY, want_logits=True))
        assert np.array_equal(retried.logits, expected.logits)

    def test_session_cancel_arriving_mid_step_abandons_it(self) -> None:
        engine = self.whole()
        key = SessionKey("mid-step", 1)
        tokens = prompt_tokens(40, self.vocab(engine))
        engine.prefill(StepRequest(key, 0, token_ids=tokens[:8]))
        abandoned: list[int] = []

        class CancelsTheSession(CancelToken):
            """On its second poll (inside the running step) cancels the whole session, as
            a concurrent ``cancel`` would, while itself never reading as cancelled."""

            __slots__ = ("polls",)

            def __init__(self) -> None:
                super().__init__()
                self.polls = 0

            @property
            def cancelled(self) -> bool:
                self.polls += 1
                if self.polls == 2:
                    abandoned.append(engine.cancel(key))
                return False

        token = CancelsTheSession()
        with raises_kind(EngineErrorKind.CANCELLED):
            engine.prefill(StepRequest(key, 8, token_ids=tokens[8:], cancel_token=token))
        assert abandoned == [1], "cancel reported the running step"
        # An engine that polls while computing stops at once instead of finishing the chunk.
        assert token.polls <= 3
        assert engine.health().active_sessions == 0
        with raises_kind(EngineErrorKind.CANCELLED):
            engine.decode(StepRequest(key, 8, token_ids=(5,), expected_past_len=8))
        assert engine.prefill(StepRequest(key, 0, token_ids=tokens)).past_len == 40

    # --- release and eviction ---

    def test_release_is_idempotent(self) -> None:
        engine = self.whole()
        key = SessionKey("release", 1)
        engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(5, self.vocab(engine))))
        assert engine.release(key) is True
        assert engine.release(key) is False
        with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
            engine.decode(StepRequest(key, 5, token_ids=(5,), expected_past_len=5))
        assert caught.value.actual_past_len == 0
        assert engine.metrics()[METRIC_SESSIONS_RELEASED] == 1
        assert engine.health().active_sessions == 0

    def test_least_recently_used_session_is_evicted_for_a_new_one(self) -> None:
        engine = self.whole()
        vocab = self.vocab(engine)
        keys = [SessionKey(f"lru{i}", 1) for i in range(self.n_seq_max + 1)]
        for key in keys[:-1]:
            engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(4, vocab)))
        engine.decode(StepRequest(keys[0], 4, token_ids=(5,), expected_past_len=4))  # keys[1] is now oldest
        engine.prefill(StepRequest(keys[-1], 0, token_ids=prompt_tokens(4, vocab)))
        with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
            engine.decode(StepRequest(keys[1], 4, token_ids=(5,), expected_past_len=4))
        assert caught.value.actual_past_len == 0
        assert engine.decode(StepRequest(keys[0], 5, token_ids=(5,), expected_past_len=5)).past_len == 6
        assert engine.metrics()[METRIC_SESSIONS_EVICTED] == 1
        assert engine.health().active_sessions == self.n_seq_max

    def test_idle_sessions_expire_after_the_ttl(self) -> None:
        engine = self.whole()
        vocab = self.vocab(engine)
        idle, busy = SessionKey("idle", 1), SessionKey("busy", 1)
        engine.prefill(StepRequest(idle, 0, token_ids=prompt_tokens(4, vocab)))
        engine.prefill(StepRequest(busy, 0, token_ids=prompt_tokens(4, vocab)))
        self.clock.advance(self.ttl_s * 0.75)
        engine.decode(StepRequest(busy, 4, token_ids=(5,), expected_past_len=4))
        self.clock.advance(self.ttl_s * 0.5)
        assert engine.health().active_sessions == 1
        with raises_kind(EngineErrorKind.CACHE_MISS):
            engine.decode(StepRequest(idle, 4, token_ids=(5,), expected_past_len=4))
        assert engine.decode(StepRequest(busy, 5, token_ids=(5,), expected_past_len=5)).past_len == 6
        assert engine.metrics()[METRIC_SESSIONS_EXPIRED] == 1

    # --- sampling and metrics ---

    def test_seeded_sampling_is_reproducible_per_sample_index(self) -> None:
        engine = self.whole()
        tokens = prompt_tokens(12, self.vocab(engine))
        params = SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=1234)

        def draw(index: int, session: str) -> int:
            result = engine.prefill(
                StepRequest(SessionKey(session, 1), 0, token_ids=tokens, sampling=params, sample_index=index)
            )
            assert result.token_id is not None
            return result.token_id

        draws = [draw(i, f"s{i}") for i in range(8)]
        assert draws == [draw(i, f"r{i}") for i in range(8)], "a replayed step draws the same token"
        assert all(0 <= d < self.vocab(engine) for d in draws)

    def test_metrics_count_steps_tokens_and_sessions(self) -> None:
        engine = self.whole()
        key = SessionKey("metrics", 1)
        engine.prefill(StepRequest(key, 0, token_ids=prompt_tokens(7, self.vocab(engine))))
        engine.decode(StepRequest(key, 7, token_ids=(5,), expected_past_len=7))
        engine.decode(StepRequest(key, 8, token_ids=(6,), expected_past_len=8))
        result = engine.decode(StepRequest(key, 9, token_ids=(6,), expected_past_len=9))
        metrics = engine.metrics()
        assert metrics[METRIC_PREFILL_STEPS] == 1 and metrics[METRIC_DECODE_STEPS] == 3
        assert metrics[METRIC_TOKENS_PROCESSED] == 10 and metrics[METRIC_SESSIONS_OPENED] == 1
        assert result.execution_nanos > 0
        health = engine.health()
        assert health.kv_tokens_used == 10 and 0.0 < health.kv_pressure <= 1.0
