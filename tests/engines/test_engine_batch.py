"""Continuous batching in the llama.cpp engine: ``step_batch`` computes several sessions'
one-token decodes in one ``llama_decode`` (a sequence per session slot), and each session gets
what it would get decoding alone.

Measured (llama-cpp-python 0.3.36, CPU, 2 threads; 20 decode steps, k = 2, 3, 4 sessions in
skipping slots, head, middle and tail shards, every hidden element and logit compared):

- Gemma 3 270M Q4_K_M, plain weights: bit-exact, largest absolute difference 0.0, hidden
  states and logits (passes of up to 7 KV streams, engines.row_invariance).
- The generated tiny model (float32 weights): not bit-exact. A batched float32 matrix product
  takes another kernel than a one-row one and rounds differently: about 1e-6 on the first
  step, compounding through the KV cache to at most 1.33e-3 after 20 steps (whole model,
  hidden magnitudes about 4), 1.1e-4 on tail logits. A batch of one session is bit-exact.
- Gemma 3 270M with repacked weights on an AMD EPYC (AVX-512, no AMX): not bit-exact, and one of
  four concurrent streams through a mesh changed its greedy text.

So the engine checks the first pass of each span (and position band) against each session
decoding alone, and where a pass rounds otherwise it runs passes spanning fewer KV streams (at
worst one session a pass) from then on. Every test here asserts batched equals solo bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from batch_parity import Stream, batch_vs_solo, feed, greedy_texts, load, skip_unless_repacked_weights_run
from engine_contract import prompt_tokens

from engines.fake import FakeEngine, FakeModelSpec
from engines.interface import (
    GREEDY,
    METRIC_CACHE_MISSES,
    METRIC_DECODE_STEPS,
    METRIC_STEPS_CANCELLED,
    BatchStep,
    CancelToken,
    EngineError,
    EngineErrorKind,
    LoadRequest,
    SessionKey,
    StepRequest,
    StepResult,
)
from engines.llama_engine import LlamaShardEngine
from engines.sessioned_engine import BatchEntry, ForwardOutput
from engines.tiny_model import TINY_N_LAYERS
from engines.tokenizer import Tokenizer

DECODE_STEPS = 20
# The Gemma cases that pin a kernel choice: a wrong one is off from the first step.
SHORT_STEPS = 12
# Slots of the batch engine (see batch_parity): k = 2, 3, 4 sessions, never all adjacent.
LAYOUTS = {
    "k2-empty-gap": ["s", "hole", "s"],
    "k3-live-gap": ["s", "s", "live", "s"],
    "k4-both-gaps": ["hole", "s", "s", "live", "s", "s"],
}
TINY_SHARDS = {"head": (0, 2), "middle": (2, 4), "tail": (4, TINY_N_LAYERS)}
GEMMA_LAYERS = 18
GEMMA_SHARDS = {"head": (0, 6), "middle": (6, 11), "tail": (11, GEMMA_LAYERS)}


def _streams(k: int, vocab: int, first_length: int = 5, steps: int = DECODE_STEPS) -> list[Stream]:
    # Different prompt lengths, so the sessions decode at different positions.
    return [
        Stream(
            SessionKey(f"s{index}", 1),
            prompt_tokens(first_length + 7 * index, vocab, seed=index),
            prompt_tokens(steps, vocab, seed=100 + index),
        )
        for index in range(k)
    ]


# --- the tiny model ---


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("shard", TINY_SHARDS.values(), ids=TINY_SHARDS.keys())
def test_tiny_batched_decode_matches_solo(
    tiny_model: Path, shard: tuple[int, int], layout: list[str]
) -> None:
    start, end = shard
    k = layout.count("s")
    streams = _streams(k, 300)
    feed(tiny_model, start, streams)
    report = batch_vs_solo(tiny_model, start, end, TINY_N_LAYERS, streams, layout)
    assert report.compared == k * DECODE_STEPS
    # llama.cpp's float32 kernels round a batch of rows otherwise (1.33e-3 off over 20 steps when
    # measured); the engine finds it on the first pass and runs those sessions alone from then on.
    assert report.max_abs_diff == 0.0
    assert report.token_mismatches == []
    assert report.gaps_untouched


def test_a_batch_of_one_is_bit_exact(tiny_model: Path) -> None:
    streams = _streams(1, 300)
    report = batch_vs_solo(tiny_model, 0, None, TINY_N_LAYERS, streams, ["hole", "s"])
    assert report.compared == DECODE_STEPS
    assert report.max_abs_diff == 0.0


def test_tiny_greedy_text_is_identical(tiny_model: Path) -> None:
    prompts = [prompt_tokens(4 + 9 * index, 300, seed=50 + index) for index in range(4)]
    engine = load(tiny_model, 0, None)
    try:
        alone = greedy_texts(engine, prompts, DECODE_STEPS, batched=False)
        together = greedy_texts(engine, prompts, DECODE_STEPS, batched=True)
    finally:
        engine.close()
    assert together == alone
    assert all(len(tokens) == DECODE_STEPS + 1 for tokens in together)


class _Skewed(LlamaShardEngine):
    """Its llama.cpp runtime's multi-row passes come out 1e-3 off: a backend whose batched
    kernels round otherwise, made so on any CPU."""

    batched_passes = 0

    def _build_runtime(self, start_layer: int):
        runtime = super()._build_runtime(start_layer)
        run_batch = runtime.run_batch

        def skewed(sequences):
            results = run_batch(sequences)
            if len(sequences) > 1:
                self.batched_passes += 1
                results = [None if r is None else r + np.float32(1e-3) for r in results]
            return results

        runtime.run_batch = skewed
        return runtime


def test_a_pass_that_rounds_otherwise_is_found_and_its_sessions_run_alone(tiny_model, caplog) -> None:
    request = LoadRequest(str(tiny_model), n_ctx=256, n_seq_max=4, n_batch=64, n_threads=2)
    batch, solo = _Skewed(), LlamaShardEngine()
    try:
        for engine in (batch, solo):
            engine.load(request)
            for index in range(3):
                engine.prefill(StepRequest(SessionKey(f"s{index}", 1), 0, token_ids=_prompt(index)))
        with caplog.at_level(logging.WARNING, logger="engines.llama_engine"):
            for step in range(3):
                outcomes = batch.step_batch([BatchStep(_decode(index, step), True) for index in range(3)])
                for index, outcome in enumerate(outcomes):
                    _close_to(outcome, solo.decode(_decode(index, step)))
        # Slots 0-2 in one pass, found off; then slots 0-1, found off too; then one a pass.
        assert batch.batched_passes == 2
        assert caplog.text.count("does not round as each session alone") == 2
        assert "span at most 1 from now on" in caplog.text
    finally:
        batch.close()
        solo.close()


# --- cancellation and refusals inside a batch (tiny model) ---


class _Hooked(LlamaShardEngine):
    """Runs ``during`` while a batch is computing: after the shared pass, before any commit."""

    during: Callable[[], object] | None = None

    def _forward_batch(self, entries: Sequence[BatchEntry]) -> list[ForwardOutput | EngineError]:
        outputs = super()._forward_batch(entries)
        if self.during is not None:
            self.during()
        return outputs


@pytest.fixture
def engines(tiny_model: Path) -> Iterator[tuple[_Hooked, LlamaShardEngine]]:
    """A batch engine and a solo reference on the whole tiny model, three sessions prefilled in each."""
    request = LoadRequest(str(tiny_model), n_ctx=256, n_seq_max=4, n_batch=64, n_threads=2)
    batch, solo = _Hooked(), LlamaShardEngine()
    batch.load(request)
    solo.load(request)
    for engine in (batch, solo):
        for index in range(3):
            engine.prefill(StepRequest(SessionKey(f"s{index}", 1), 0, token_ids=_prompt(index)))
    yield batch, solo
    batch.close()
    solo.close()


def _prompt(index: int) -> tuple[int, ...]:
    return prompt_tokens(6 + 5 * index, 300, seed=index)


def _decode(index: int, step: int = 0, token: CancelToken | None = None, shift: int = 0) -> StepRequest:
    position = len(_prompt(index)) + step + shift
    return StepRequest(
        SessionKey(f"s{index}", 1),
        position,
        token_ids=(17 + step,),
        expected_past_len=position,
        sampling=GREEDY,
        want_logits=True,
        cancel_token=token,
    )


def _close_to(got: StepResult | EngineError, expected: StepResult) -> None:
    """Batched equals solo bit for bit (a pass that rounds otherwise is found and run alone)."""
    assert isinstance(got, StepResult), got
    assert got.past_len == expected.past_len and got.token_id == expected.token_id
    assert got.logits is not None and expected.logits is not None
    np.testing.assert_array_equal(got.logits, expected.logits)


def _kind(outcome: StepResult | EngineError) -> EngineErrorKind:
    assert isinstance(outcome, EngineError), outcome
    return outcome.kind


def test_a_token_cancelled_before_the_batch_cancels_only_its_step(engines) -> None:
    batch, solo = engines
    token = CancelToken()
    token.cancel()
    before = batch.metrics()[METRIC_STEPS_CANCELLED]
    outcomes = batch.step_batch(
        [BatchStep(_decode(0), True), BatchStep(_decode(1, token=token), True), BatchStep(_decode(2), True)]
    )
    assert _kind(outcomes[1]) == EngineErrorKind.CANCELLED
    _close_to(outcomes[0], solo.decode(_decode(0)))
    _close_to(outcomes[2], solo.decode(_decode(2)))
    assert batch.metrics()[METRIC_STEPS_CANCELLED] == before + 1
    # Its session kept its cache and never saw a batch: its next step alone is bit-exact.
    again, alone = batch.decode(_decode(1)), solo.decode(_decode(1))
    assert again.past_len == alone.past_len
    assert np.array_equal(again.logits, alone.logits)


def test_a_token_cancelled_during_the_batch_rolls_its_step_back(engines) -> None:
    batch, solo = engines
    token = CancelToken()
    batch.during = token.cancel
    outcomes = batch.step_batch(
        [BatchStep(_decode(index, token=token if index == 0 else None), True) for index in range(3)]
    )
    batch.during = None
    assert _kind(outcomes[0]) == EngineErrorKind.CANCELLED
    _close_to(outcomes[1], solo.decode(_decode(1)))
    _close_to(outcomes[2], solo.decode(_decode(2)))
    # What the batch computed for it was removed from the cache: the same step alone now
    # gives exactly the solo answer (a leftover KV cell would change it or be refused).
    again, alone = batch.decode(_decode(0)), solo.decode(_decode(0))
    assert again.past_len == alone.past_len
    assert np.array_equal(again.logits, alone.logits)


def test_a_session_cancelled_during_the_batch_is_dropped_and_the_others_commit(engines) -> None:
    batch, solo = engines
    victim = SessionKey("s2", 1)
    batch.during = lambda: batch.cancel(victim)
    outcomes = batch.step_batch([BatchStep(_decode(index), True) for index in range(3)])
    batch.during = None
    assert _kind(outcomes[2]) == EngineErrorKind.CANCELLED
    _close_to(outcomes[0], solo.decode(_decode(0)))
    _close_to(outcomes[1], solo.decode(_decode(1)))
    with pytest.raises(EngineError) as refused:
        batch.decode(_decode(2))
    assert refused.value.kind == EngineErrorKind.CANCELLED
    assert batch.health().active_sessions == 2
    # The batch left nothing marked running: a later cancel of a batched session is a plain
    # cancel (0 units abandoned), not an abort of its next step.
    assert batch.cancel(SessionKey("s0", 1)) == 0


def test_a_cache_miss_is_that_entrys_only(engines) -> None:
    batch, solo = engines
    before = batch.metrics()
    outcomes = batch.step_batch(
        [BatchStep(_decode(0), True), BatchStep(_decode(1, shift=3), True), BatchStep(_decode(2), True)]
    )
    miss = outcomes[1]
    assert _kind(miss) == EngineErrorKind.CACHE_MISS
    assert isinstance(miss, EngineError) and miss.actual_past_len == len(_prompt(1))
    _close_to(outcomes[0], solo.decode(_decode(0)))
    _close_to(outcomes[2], solo.decode(_decode(2)))
    after = batch.metrics()
    assert after[METRIC_CACHE_MISSES] == before[METRIC_CACHE_MISSES] + 1
    assert after[METRIC_DECODE_STEPS] == before[METRIC_DECODE_STEPS] + 2
    # The refused session is where it was.
    assert batch.decode(_decode(1)).past_len == len(_prompt(1)) + 1


def test_prefills_and_duplicates_in_a_batch(engines) -> None:
    batch, solo = engines
    fresh = StepRequest(SessionKey("new", 1), 0, token_ids=_prompt(5), sampling=GREEDY, want_logits=True)
    outcomes = batch.step_batch(
        [BatchStep(_decode(0), True), BatchStep(fresh, False), BatchStep(_decode(0), True)]
    )
    _close_to(outcomes[0], solo.decode(_decode(0)))
    assert _kind(outcomes[2]) == EngineErrorKind.INVALID_REQUEST
    # A prefill runs alone, exactly as prefill() runs it.
    alone = solo.prefill(fresh)
    assert isinstance(outcomes[1], StepResult) and outcomes[1].cache_hit is False
    assert np.array_equal(outcomes[1].logits, alone.logits)


def test_more_decodes_than_one_pass_holds(tiny_model: Path) -> None:
    """n_batch 2 with 4 sessions: two passes, and the first pass's logits survive the second."""
    request = LoadRequest(str(tiny_model), n_ctx=128, n_seq_max=4, n_batch=2, n_threads=2)
    batch, solo = LlamaShardEngine(), LlamaShardEngine()
    try:
        for engine in (batch, solo):
            engine.load(request)
            for index in range(4):
                for start in range(0, len(_prompt(index)), 2):
                    chunk = _prompt(index)[start : start + 2]
                    engine.prefill(StepRequest(SessionKey(f"s{index}", 1), start, token_ids=chunk))
        outcomes = batch.step_batch([BatchStep(_decode(index), True) for index in range(4)])
        for index, outcome in enumerate(outcomes):
            _close_to(outcome, solo.decode(_decode(index)))
    finally:
        batch.close()
        solo.close()


def test_the_fake_engine_batches_like_it_steps_alone() -> None:
    spec = FakeModelSpec(total_layers=4)
    batch, solo = FakeEngine(spec), FakeEngine(spec)
    for engine in (batch, solo):
        engine.load(LoadRequest("fake", n_ctx=64, n_seq_max=4))
        for index in range(3):
            engine.prefill(StepRequest(SessionKey(f"s{index}", 1), 0, token_ids=(1 + index, 2, 3)))
    requests = [
        StepRequest(
            SessionKey(f"s{index}", 1),
            3,
            token_ids=(5,),
            expected_past_len=3,
            sampling=GREEDY,
            want_logits=True,
        )
        for index in range(3)
    ]
    outcomes = batch.step_batch([BatchStep(request, True) for request in requests])
    for outcome, request in zip(outcomes, requests, strict=True):
        alone = solo.decode(request)
        assert isinstance(outcome, StepResult)
        assert outcome.token_id == alone.token_id and np.array_equal(outcome.logits, alone.logits)


# --- Gemma 3 270M ---


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_model: Path) -> Iterator[Tokenizer]:
    with Tokenizer.open(gemma_model) as opened:
        yield opened


# A Latin square of shard positions and layouts, not all nine pairs: each position (head hidden
# rows, middle hidden rows fed hidden inputs, tail logits and greedy tokens) and each layout (k = 2
# with an empty gap, 3 with a live gap, 4 with both) is run once. Whether a pass rounds as its rows
# alone do is a property of the batch's rows and of the kernels a shard's role takes, which these
# cover; a position and a layout do not interact beyond that (the tiny model runs all nine pairs
# above, and the Gemma head also decodes a live gap past position 256 and nine sessions below).
GEMMA_CASES = {
    "head-k4-both-gaps": ("head", "k4-both-gaps"),
    "middle-k2-empty-gap": ("middle", "k2-empty-gap"),
    "tail-k3-live-gap": ("tail", "k3-live-gap"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", GEMMA_CASES.values(), ids=GEMMA_CASES.keys())
def test_gemma_batched_decode_is_bit_exact(gemma_model: Path, case: tuple[str, str]) -> None:
    shard, layout_name = case
    start, end = GEMMA_SHARDS[shard]
    layout = LAYOUTS[layout_name]
    k = layout.count("s")
    streams = _streams(k, 5000)
    feed(gemma_model, start, streams)
    report = batch_vs_solo(gemma_model, start, end, GEMMA_LAYERS, streams, layout)
    assert report.compared == k * DECODE_STEPS
    assert report.max_abs_diff == 0.0
    assert report.token_mismatches == []
    assert report.gaps_untouched


@pytest.mark.slow
def test_gemma_batched_decode_is_bit_exact_past_position_256(gemma_model: Path) -> None:
    """Decodes from positions 245, 252 and 259 on (12 steps): a session alone there would attend through
    llama.cpp's split-KV path if its K and V caches shared a type (engines.llama_runtime keeps
    them apart on the CPU), and a batch never does; alone and batched must still agree. (The head
    shard: no inputs to compute first, and its hidden rows show any kernel difference.)"""
    start, end = GEMMA_SHARDS["head"]
    layout = LAYOUTS["k3-live-gap"]
    streams = _streams(layout.count("s"), 5000, first_length=245, steps=SHORT_STEPS)
    feed(gemma_model, start, streams)
    report = batch_vs_solo(gemma_model, start, end, GEMMA_LAYERS, streams, layout)
    assert report.compared == 3 * SHORT_STEPS
    assert report.max_abs_diff == 0.0
    assert report.token_mismatches == []


@pytest.mark.slow
def test_gemma_batch_of_nine_sessions_is_bit_exact(gemma_model: Path) -> None:
    """Nine sessions over ten slots (a live one in between): one pass of all of them would
    be ten rows, which ggml computes with its tiled k-quant kernel and rounds otherwise; the
    engine runs passes spanning at most 7 slots (engines.row_invariance), each row as alone.
    On the head shard, whose hidden rows show any kernel difference."""
    start, end = GEMMA_SHARDS["head"]
    layout = ["s"] * 4 + ["live"] + ["s"] * 5
    streams = _streams(9, 5000, steps=SHORT_STEPS)
    feed(gemma_model, start, streams)
    report = batch_vs_solo(gemma_model, start, end, GEMMA_LAYERS, streams, layout, n_seq_max=len(layout))
    assert report.compared == 9 * SHORT_STEPS
    assert report.max_abs_diff == 0.0
    assert report.token_mismatches == []
    assert report.gaps_untouched


GEMMA_PROMPTS = [
    "The capital of France is",
    "Write a haiku about a relay race of computers passing one thought along:",
    "List three reasons why a language model split across several machines must give exactly the same "
    "answer as the whole model on one machine:",
    "Once upon a time",
]


@pytest.mark.slow
def test_gemma_greedy_text_is_identical(gemma_model: Path, gemma_tokenizer: Tokenizer) -> None:
    prompts = [tuple(gemma_tokenizer.tokenize(text)) for text in GEMMA_PROMPTS]
    engine = load(gemma_model, 0, None)
    try:
        alone = greedy_texts(engine, prompts, DECODE_STEPS, batched=False)
        together = greedy_texts(engine, prompts, DECODE_STEPS, batched=True)
    finally:
        engine.close()
    assert together == alone
    texts = [gemma_tokenizer.detokenize(tokens) for tokens in together]
    assert texts == [gemma_tokenizer.detokenize(tokens) for tokens in alone]
    assert all(len(tokens) == DECODE_STEPS + 1 for tokens in together)


@pytest.mark.slow
def test_gemma_with_repacked_weights_gives_each_batched_session_its_solo_text(
    gemma_model: Path, gemma_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Repacked weights take other kernels, which nobody traced for batches (on an AMD EPYC they
    changed a greedy token): the engine's check must keep every session's text its own."""
    skip_unless_repacked_weights_run(gemma_model, tmp_path)
    prompts = [tuple(gemma_tokenizer.tokenize(text)) for text in GEMMA_PROMPTS]
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(str(gemma_model), n_ctx=512, n_seq_max=6, n_batch=256, n_threads=2, weight_repack=True)
    )
    try:
        alone = greedy_texts(engine, prompts, DECODE_STEPS, batched=False)
        together = greedy_texts(engine, prompts, DECODE_STEPS, batched=True)
    finally:
        engine.close()
    assert together == alone
