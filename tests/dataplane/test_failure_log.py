"""Which engine failures the node's log explains: unexpected ones, not the refusals of normal operation."""

from __future__ import annotations

import logging

import pytest

from engines.interface import EngineError, EngineErrorKind
from meshnode.dataplane.failure_log import log_engine_failures


def test_normal_refusals_are_not_logged_and_failures_are(caplog: pytest.LogCaptureFixture) -> None:
    outcomes: list[object] = [
        EngineError(EngineErrorKind.CANCELLED, "step cancelled while running"),
        EngineError(EngineErrorKind.CACHE_MISS, "past_len 3 != 5", actual_past_len=3),
        "a result",
        EngineError(EngineErrorKind.INTERNAL, "llama_decode returned -3"),
        ValueError("bad shape"),
    ]
    with caplog.at_level(logging.INFO, logger="meshnode.dataplane"):
        assert log_engine_failures(outcomes, 5) == 2
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "engine refused step 4 of 5: internal: llama_decode returned -3"),
        ("ERROR", "engine failed on step 5 of 5: ValueError('bad shape')"),
    ]
    assert caplog.records[1].exc_info is not None


def test_a_batch_that_raised_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="meshnode.dataplane"):
        assert log_engine_failures(MemoryError(), 3) == 1
        assert log_engine_failures(["ok", "ok"], 2) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "engine failed on a batch of 3 step(s): MemoryError()"
    ]
