"""Which message a shard session stream may carry when, and what an open or a unit must match.

Pure rules over a stream's phase and the messages it sends (no state, no clock): the worker
(:mod:`.worker`) asks, and either does what the answer names or sends the refusal.

The phase table: a stream's first frame is its ``SessionRoute`` (read apart, before any of
this), then ``AWAIT_OPEN`` takes only a ``SessionOpen``; an ``OPEN`` work stream takes work,
signals and flow control; an answer stream (``SessionOpen.answer_stream``) is granted no credit
and takes flow control alone. Work out of place is a FLOW_CONTROL_VIOLATION (it had no credit);
anything else out of place is PAYLOAD_CORRUPT. Every refusal from the table ends the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from engines.interface import EngineCapabilities
from meshnode.dataplane import errors
from meshnode.dataplane.envelope import digests, range_tuple
from meshnode.dataplane.worker_state import StreamPhase, StreamState
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


class Move(Enum):
    """What a legal request on a stream leads to."""

    OPEN = "open"
    UNIT = "unit"
    CANCEL = "cancel"
    RELEASE = "release"
    FLOW_CONTROL = "flow_control"


# A request kind that the phase does not allow: the error that ends the stream, given the kind.
_Refuse = Callable[[str], ShardProtocolError]


def _work_before_open(_kind: str) -> ShardProtocolError:
    return errors.flow_control_violation("work sent before the session opened")


def _before_open(kind: str) -> ShardProtocolError:
    return errors.payload_corrupt(f"{kind} before SessionOpen")


def _already_open(_kind: str) -> ShardProtocolError:
    return errors.payload_corrupt("the session is already open")


def _no_work_on_answers(_kind: str) -> ShardProtocolError:
    return errors.flow_control_violation("an answer stream carries no work")


def _empty(_kind: str) -> ShardProtocolError:
    return errors.payload_corrupt("empty request")


# The kinds of SessionRequest, and "" for a request that sets none.
_KINDS = ("open", "decode", "chunk", "cancel", "release", "flow_control", "")

# (phase, answer stream) -> request kind -> what follows. Every kind has an entry in every row.
_TABLE: dict[tuple[StreamPhase, bool], dict[str, Move | _Refuse]] = {
    (StreamPhase.AWAIT_OPEN, False): {
        "open": Move.OPEN,
        "decode": _work_before_open,
        "chunk": _work_before_open,
        "cancel": _before_open,
        "release": _before_open,
        "flow_control": _before_open,
        "": lambda _kind: errors.payload_corrupt("empty request before SessionOpen"),
    },
    (StreamPhase.OPEN, False): {
        "open": _already_open,
        "decode": Move.UNIT,
        "chunk": Move.UNIT,
        "cancel": Move.CANCEL,
        "release": Move.RELEASE,
        "flow_control": Move.FLOW_CONTROL,
        "": _empty,
    },
    (StreamPhase.OPEN, True): {
        **{kind: _no_work_on_answers for kind in _KINDS},
        "flow_control": Move.FLOW_CONTROL,
    },
}


def request_move(stream: StreamState, kind: str) -> Move | ShardProtocolError:
    """What a request of ``kind`` (``SessionRequest.WhichOneof("kind")``, "" for none) on
    ``stream`` leads to, or the terminal error it earns. A closed stream, or one still waiting
    for its route, is never asked: its frames are dropped or read as the route."""
    rule = _TABLE[(stream.phase, stream.answer_only)][kind]
    return rule if isinstance(rule, Move) else rule(kind)


def open_refusal(
    open_: shard.SessionOpen,
    capabilities: EngineCapabilities,
    served: tuple[str, str],
    *,
    max_session_id_length: int,
) -> ShardProtocolError | None:
    """Why this worker cannot take ``open_`` (``served``: the digests of its fingerprint), or
    ``None``. Every refusal here ends the stream."""
    if open_.schema_version == shard.SCHEMA_VERSION_UNSPECIFIED:
        return errors.refusal(shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "schema version is unspecified")
    if digests(open_.fingerprint) != served:
        return errors.refusal(
            shard.ERROR_CODE_FINGERPRINT_MISMATCH, "fingerprint differs from the served one"
        )
    r, caps = open_.shard_range, capabilities
    if (
        r.start_layer != caps.layer_start
        or r.end_layer != caps.layer_end
        or not r.start_layer <= r.effective_start_layer < r.end_layer
    ):
        return errors.refusal(
            shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
            f"this worker serves [{caps.layer_start}, {caps.layer_end}) with an effective start inside it",
        )
    session_id = open_.route_session_id
    # Control characters are refused so that no peer can name a worker-internal scratch session.
    if not session_id or len(session_id) > max_session_id_length or not session_id.isprintable():
        return errors.payload_corrupt("route session id is empty, too long or not printable")
    if open_.answer_stream and not caps.is_tail:
        return errors.refusal(
            shard.ERROR_CODE_SHARD_RANGE_MISMATCH, "only the tail answers the head directly"
        )
    return None


def envelope_refusal(
    stream: StreamState, envelope: shard.Envelope, served: tuple[str, str]
) -> ShardProtocolError | None:
    """Why a chunk's envelope does not belong on ``stream`` (the unit is refused, the stream
    goes on), or ``None``."""
    if envelope.schema_version != stream.schema_version:
        return errors.refusal(
            shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "envelope schema version differs from the negotiated one"
        )
    if envelope.route_session_id != stream.session_id:
        return errors.payload_corrupt("envelope names another route session than the stream's")
    if digests(envelope.fingerprint) != served:
        return errors.refusal(
            shard.ERROR_CODE_FINGERPRINT_MISMATCH, "fingerprint differs from the served one"
        )
    if range_tuple(envelope.shard_range) != stream.shard_range:
        return errors.refusal(
            shard.ERROR_CODE_SHARD_RANGE_MISMATCH, "envelope shard range differs from the session's"
        )
    return None


def unit_flow_refusal(
    stream: StreamState, request: shard.SessionRequest, kind: str, size: int
) -> ShardProtocolError | None:
    """The flow-control violation a unit of ``size`` bytes commits on ``stream``, or ``None``;
    every one ends the stream."""
    flow = stream.flow
    assert flow is not None
    if size > flow.max_chunk_bytes:
        return errors.flow_control_violation(f"unit of {size} bytes over max_chunk_bytes")
    if stream.unacked >= stream.window:
        return errors.flow_control_violation(f"more than {stream.window} un-acked units")
    if kind == "chunk" and request.chunk.envelope.position.token_count > flow.max_prefill_chunk_tokens:
        return errors.flow_control_violation("chunk carries more than max_prefill_chunk_tokens")
    return None


__all__ = ["Move", "envelope_refusal", "open_refusal", "request_move", "unit_flow_refusal"]
