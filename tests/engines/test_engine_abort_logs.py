"""An abort meshnode asked for (cancel, deadline) is logged at debug with its session id; llama.cpp's
own failure lines for it are not errors. Real engine, tiny model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engines.interface import CancelToken, EngineError, EngineErrorKind, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.llama_lib import requested_abort


class CancelledOnceRunning(CancelToken):
    """Not cancelled when the step starts; cancelled when llama.cpp polls it mid-graph."""

    __slots__ = ("_polls",)

    def __init__(self) -> None:
        super().__init__()
        self._polls = 0

    @property
    def cancelled(self) -> bool:
        self._polls += 1
        return self._polls > 1


def test_a_requested_abort_is_debug_not_error(tiny_model: Path, caplog: pytest.LogCaptureFixture):
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(tiny_model), 0, None, n_ctx=128, n_seq_max=1, n_batch=32, n_threads=1))
    key = SessionKey("session-to-cancel", 0)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(EngineError) as error:
        engine.prefill(
            StepRequest(key, 0, token_ids=tuple(range(1, 17)), cancel_token=CancelledOnceRunning())
        )
    assert error.value.kind is EngineErrorKind.CANCELLED
    assert "while running" in error.value.detail, "the abort must have happened inside llama_decode"
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    aborted = [r.getMessage() for r in caplog.records if "step aborted as asked" in r.getMessage()]
    assert aborted and "session-to-cancel" in aborted[0]
    assert any("after a requested abort: " in r.getMessage() for r in caplog.records)
    assert not requested_abort.active, "later failures must be logged as failures again"
    # The session starts over cleanly after the cancelled step.
    result = engine.prefill(StepRequest(key, 0, token_ids=(1, 2, 3)))
    assert result.past_len == 3
    engine.close()
