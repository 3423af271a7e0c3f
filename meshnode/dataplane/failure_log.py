"""Say in the node's log why a step failed inside the engine.

A peer only hears ``ERROR_CODE_INTERNAL`` and a fixed detail (the exception's text may
name paths or memory, :func:`meshnode.dataplane.errors.from_engine_failure`), so the
operator's log is the one place the cause can be read. Refusals that are part of
normal operation (a cancelled step, a cache miss, a stale epoch) are not logged.
"""

from __future__ import annotations

import logging

from engines.interface import EngineError, EngineErrorKind

log = logging.getLogger(__name__)

# Kinds a healthy engine raises in normal operation; the peer's typed error says all there is.
_EXPECTED = frozenset(
    {
        EngineErrorKind.CACHE_MISS,
        EngineErrorKind.EPOCH_STALE,
        EngineErrorKind.CANCELLED,
        EngineErrorKind.RESOURCE_EXHAUSTED,
        EngineErrorKind.INVALID_REQUEST,
    }
)


def log_engine_failures(outcome: object, steps: int) -> int:
    """Log each unexpected failure in a batch's ``outcome`` (the exception the batch raised, or
    the list of its steps' outcomes); returns how many were logged."""
    if isinstance(outcome, BaseException):
        _log_one(outcome, f"a batch of {steps} step(s)")
        return 1
    logged = 0
    if isinstance(outcome, list):
        for index, item in enumerate(outcome):
            if isinstance(item, BaseException) and _log_one(item, f"step {index + 1} of {steps}"):
                logged += 1
    return logged


def _log_one(failure: BaseException, what: str) -> bool:
    if isinstance(failure, EngineError):
        if failure.kind in _EXPECTED:
            return False
        log.warning("engine refused %s: %s", what, failure)
        return True
    log.error("engine failed on %s: %r", what, failure, exc_info=failure)
    return True


__all__ = ["log_engine_failures"]
