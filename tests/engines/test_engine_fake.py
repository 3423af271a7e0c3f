"""The fake engine: the shared contract, exact chaining, and every injectable fault."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from engine_contract import EngineContract, ManualClock, prompt_tokens, raises_kind

from engines.fake import FakeEngine, FakeModelSpec, FaultKind, FaultRule, InjectedCrash
from engines.interface import (
    GREEDY,
    EngineError,
    EngineErrorKind,
    EngineFingerprint,
    LoadRequest,
    SessionKey,
    StepRequest,
)

SPEC = FakeModelSpec(total_layers=8, hidden_size=16, vocab_size=64, seed=3)


class TestFakeEngineContract(EngineContract):
    def new_engine(self, clock: ManualClock) -> FakeEngine:
        return FakeEngine(SPEC, clock=clock)

    def model_path(self) -> str:
        return "fake"


def loaded(layer_start: int = 0, layer_end: int | None = None, **kwargs: Any) -> FakeEngine:
    engine = FakeEngine(SPEC, **kwargs)
    engine.load(LoadRequest("fake", layer_start, layer_end, n_ctx=256, n_seq_max=2))
    return engine


KEY = SessionKey("s", 1)


@pytest.mark.parametrize("split", range(1, SPEC.total_layers))
def test_two_shards_split_anywhere_equal_the_whole_model(split: int) -> None:
    whole, head, tail = loaded(), loaded(0, split), loaded(split)
    tokens = prompt_tokens(20, SPEC.vocab_size)
    expected = whole.prefill(StepRequest(KEY, 0, token_ids=tokens, sampling=GREEDY, want_logits=True))
    hidden = head.prefill(StepRequest(KEY, 0, token_ids=tokens)).hidden
    got = tail.prefill(StepRequest(KEY, 0, hidden=hidden, sampling=GREEDY, want_logits=True))
    assert np.array_equal(got.logits, expected.logits)


def test_token_by_token_decode_equals_one_prefill() -> None:
    tokens = prompt_tokens(12, SPEC.vocab_size)
    batch = loaded().prefill(StepRequest(KEY, 0, token_ids=tokens, want_logits=True, sampling=GREEDY))
    stepwise = loaded()
    stepwise.prefill(StepRequest(KEY, 0, token_ids=tokens[:1]))
    for position in range(1, len(tokens)):
        result = stepwise.decode(
            StepRequest(
                KEY,
                position,
                token_ids=tokens[position : position + 1],
                expected_past_len=position,
                want_logits=True,
                sampling=GREEDY,
            )
        )
    assert np.array_equal(result.logits, batch.logits)


def test_fingerprint_is_configurable_and_spec_derived_by_default() -> None:
    custom = EngineFingerprint("a" * 64, "b" * 64, recipe_id="custom")
    assert loaded(fingerprint=custom).capabilities().fingerprint == custom
    other = FakeEngine(FakeModelSpec(seed=99))
    other.load(LoadRequest("fake"))
    assert (
        other.capabilities().fingerprint.model_artifact_digest
        != loaded().capabilities().fingerprint.model_artifact_digest
    )


def test_memory_pressure_is_resource_exhausted_and_keeps_the_session() -> None:
    engine = loaded()
    engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2, 3)))
    engine.inject(FaultRule(FaultKind.MEMORY_PRESSURE, times=1))
    with raises_kind(EngineErrorKind.RESOURCE_EXHAUSTED):
        engine.decode(StepRequest(KEY, 3, token_ids=(4,), expected_past_len=3))
    assert engine.decode(StepRequest(KEY, 3, token_ids=(4,), expected_past_len=3)).past_len == 4


def test_malformed_hidden_outputs() -> None:
    engine = loaded(0, 4, faults=[FaultRule(FaultKind.MALFORMED_SHAPE, times=1)])
    assert engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2))).hidden.shape == (2, SPEC.hidden_size + 1)
    engine.inject(FaultRule(FaultKind.MALFORMED_NAN, times=1))
    assert np.isnan(engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2))).hidden).all()
    assert np.isfinite(engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2))).hidden).all(), (
        "faults were one-shot"
    )


def test_malformed_tail_outputs() -> None:
    engine = loaded(4, None, faults=[FaultRule(FaultKind.MALFORMED_SHAPE, times=1)])
    hidden = np.ones((2, SPEC.hidden_size), dtype=np.float32)
    result = engine.prefill(StepRequest(KEY, 0, hidden=hidden, sampling=GREEDY, want_logits=True))
    assert result.token_id == SPEC.vocab_size and result.logits.shape == (SPEC.vocab_size + 1,)
    engine.inject(FaultRule(FaultKind.MALFORMED_NAN, times=1))
    assert np.isnan(engine.prefill(StepRequest(KEY, 0, hidden=hidden, want_logits=True)).logits).all()


def test_crash_raises_an_unexpected_exception_and_drops_the_session() -> None:
    engine = loaded(faults=[FaultRule(FaultKind.CRASH, after_steps=1, times=1)])
    engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2)))
    with pytest.raises(InjectedCrash):
        engine.decode(StepRequest(KEY, 2, token_ids=(3,), expected_past_len=2))
    with raises_kind(EngineErrorKind.CACHE_MISS) as caught:
        engine.decode(StepRequest(KEY, 2, token_ids=(3,), expected_past_len=2))
    assert caught.value.actual_past_len == 0
    assert engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2))).past_len == 2


def test_fault_rules_filter_by_session_and_count() -> None:
    engine = loaded(
        faults=[FaultRule(FaultKind.MEMORY_PRESSURE, after_steps=1, times=2, session_id="victim")]
    )
    outcomes = []
    for session in ("victim", "other", "victim", "victim", "victim", "other"):
        try:
            engine.prefill(StepRequest(SessionKey(session, 1), 0, token_ids=(1,)))
            outcomes.append("ok")
        except EngineError as error:
            outcomes.append(error.kind.value)
    assert outcomes == ["ok", "ok", "resource_exhausted", "resource_exhausted", "ok", "ok"]


def test_exit_fault_kills_the_process_with_its_code() -> None:
    script = (
        "from engines.fake import FakeEngine, FaultRule, FaultKind\n"
        "from engines.interface import LoadRequest, SessionKey, StepRequest\n"
        "e = FakeEngine(faults=[FaultRule(FaultKind.EXIT, exit_code=41)])\n"
        "e.load(LoadRequest('fake'))\n"
        "e.prefill(StepRequest(SessionKey('s', 1), 0, token_ids=(1,)))\n"
        "print('survived')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 41 and "survived" not in done.stdout


@pytest.mark.timeout(30)
def test_cancel_from_another_thread_abandons_the_delayed_step() -> None:
    entered = threading.Event()

    def sleep(seconds: float) -> None:
        entered.set()
        time.sleep(min(seconds, 0.005))

    engine = loaded(step_delay_s=3600.0, sleep=sleep)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2, 3))))
        except EngineError as error:
            outcome.append(error.kind)

    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(10)
    assert engine.cancel(KEY) == 1, "one running step was abandoned"
    worker.join(10)
    assert outcome == [EngineErrorKind.CANCELLED]
    engine.step_delay_s = 0.0
    with raises_kind(EngineErrorKind.CANCELLED):
        engine.decode(StepRequest(KEY, 3, token_ids=(4,), expected_past_len=3))
    assert engine.prefill(StepRequest(KEY, 0, token_ids=(1, 2, 3))).past_len == 3
