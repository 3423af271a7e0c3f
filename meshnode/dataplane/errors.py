"""Every refusal the data plane sends, and the one table that maps engine failures to wire codes.

A detail that crosses the wire is always one of the fixed strings below or a
sentence built here from numbers: engine exception text, paths and peer input
never reach a peer.
"""

from __future__ import annotations

from engines.interface import EngineError, EngineErrorKind
from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.pb import shard

ENGINE_FAILURE_DETAIL = "the engine failed while executing this unit"
MALFORMED_RESULT_DETAIL = "the engine produced a malformed result"

# EngineErrorKind -> (ErrorCode, retryable, fixed detail).
ENGINE_ERROR_TABLE: dict[EngineErrorKind, tuple[shard.ErrorCode, bool, str]] = {
    EngineErrorKind.CACHE_MISS: (
        shard.ERROR_CODE_CACHE_MISS,
        False,
        "session cache is not positioned as expected",
    ),
    EngineErrorKind.EPOCH_STALE: (shard.ERROR_CODE_EPOCH_STALE, False, "route epoch is stale"),
    EngineErrorKind.CANCELLED: (shard.ERROR_CODE_CANCELLED, False, "unit was cancelled"),
    EngineErrorKind.RESOURCE_EXHAUSTED: (
        shard.ERROR_CODE_RESOURCE_EXHAUSTED,
        True,
        "engine capacity is exhausted",
    ),
    # The request the worker built from the payload was refused by the engine.
    EngineErrorKind.INVALID_REQUEST: (
        shard.ERROR_CODE_PAYLOAD_CORRUPT,
        False,
        "payload does not form a valid step",
    ),
    # Loading may still be under way; the same unit can succeed later.
    EngineErrorKind.NOT_LOADED: (shard.ERROR_CODE_INTERNAL, True, "the engine is not loaded"),
    EngineErrorKind.UNSUPPORTED_MODEL: (
        shard.ERROR_CODE_INTERNAL,
        False,
        "the engine cannot run this model",
    ),
    EngineErrorKind.INTERNAL: (shard.ERROR_CODE_INTERNAL, False, ENGINE_FAILURE_DETAIL),
}


def refusal(
    code: shard.ErrorCode, detail: str, *, retryable: bool = False, actual_past_len: int = 0
) -> ShardProtocolError:
    return ShardProtocolError(detail, code=code, retryable=retryable, actual_past_len=actual_past_len)


def from_engine_failure(failure: BaseException) -> ShardProtocolError:
    """The wire refusal for whatever a step raised; never carries the exception's text."""
    if isinstance(failure, EngineError):
        code, retryable, detail = ENGINE_ERROR_TABLE[failure.kind]
        actual = failure.actual_past_len if failure.kind is EngineErrorKind.CACHE_MISS else 0
        return refusal(code, detail, retryable=retryable, actual_past_len=actual)
    return refusal(shard.ERROR_CODE_INTERNAL, ENGINE_FAILURE_DETAIL)


def cache_miss(detail: str, actual_past_len: int) -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_CACHE_MISS, detail, actual_past_len=actual_past_len)


def payload_corrupt(detail: str) -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_PAYLOAD_CORRUPT, detail)


def flow_control_violation(detail: str) -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_FLOW_CONTROL_VIOLATION, detail)


def resource_exhausted(detail: str, *, retryable: bool = True) -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_RESOURCE_EXHAUSTED, detail, retryable=retryable)


def deadline_exceeded() -> ShardProtocolError:
    # A retry carrying the same (passed) deadline can only fail again.
    return refusal(shard.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before the unit finished")


def cancelled(detail: str = "unit was cancelled") -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_CANCELLED, detail)


def epoch_stale(session_epoch: int) -> ShardProtocolError:
    return refusal(shard.ERROR_CODE_EPOCH_STALE, f"route epoch is older than the session's ({session_epoch})")


class SessionTransportError(MeshnodeError):
    """The transport under a session failed and the unit could not be delivered.

    Distinct from :class:`ShardProtocolError`: no worker refused anything, the
    bytes just stopped flowing (stream reset, connection lost, retries spent).
    """


__all__ = [
    "ENGINE_ERROR_TABLE",
    "ENGINE_FAILURE_DETAIL",
    "MALFORMED_RESULT_DETAIL",
    "SessionTransportError",
    "cache_miss",
    "cancelled",
    "deadline_exceeded",
    "epoch_stale",
    "flow_control_violation",
    "from_engine_failure",
    "payload_corrupt",
    "refusal",
    "resource_exhausted",
]
