"""The unary calls (GetCapability, Health, Release, Cancel): one request, one response, a fresh stream each.

Handlers are pure functions over a :class:`~meshnode.dataplane.worker.ShardWorker`
(and, for capability and health, what the engine reported); Release and Cancel
also return the worker actions they cause (CANCELLED statuses on the session's
streams, a FireCancel, engine and next-hop releases).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
from google.protobuf.message import DecodeError, Message

from engines.interface import GREEDY, EngineHealth, SessionKey, ShardEngine, StepRequest
from meshnode.dataplane.actions import Action
from meshnode.dataplane.envelope import SUPPORTED_SCHEMA_VERSIONS
from meshnode.dataplane.errors import epoch_stale, payload_corrupt, refusal
from meshnode.dataplane.payload import HopRole, check_result
from meshnode.dataplane.worker import ShardWorker
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import shard

# Not printable, so no peer's route session can share the scratch session's key.
PROBE_SESSION = SessionKey("\x00capability-probe", 0)
PROBE_TOKENS = 4
VALIDATION_FAILED_DETAIL = "bounded forward of the served range failed"


@dataclass(frozen=True)
class Validation:
    """Outcome of the bounded real forward that a CapabilityReport's ``validated`` rests on."""

    validated: bool
    detail: str
    validated_at_unix_nanos: int
    # What its steps took (monotonic ns): the decode step, and the prefill per token. The shard's
    # first estimate of its speed (meshnode.dataplane.stage_speed); 0 when it failed.
    decode_ns: int = 0
    prefill_ns_per_token: int = 0


def validate_engine(engine: ShardEngine, *, unix_now_ns: int, probe_tokens: int = PROBE_TOKENS) -> Validation:
    """Run a few tokens through the served range on a scratch session and check the outputs.

    A prefill then one decode step; each output must be finite and correctly shaped
    for the range's role. The scratch state is always released. Runs on the engine
    thread (it calls the engine). Failure details are fixed strings. ``unix_now_ns`` is the
    wall-clock instant a passed validation reports (``validated_at_unix_nanos``).
    """
    try:
        caps = engine.capabilities()
        role = HopRole(
            takes_tokens=caps.is_head,
            is_tail=caps.is_tail,
            hidden_size=caps.hidden_size,
            vocab_size=caps.vocab_size,
            boundary_dtype=shard.DTYPE_FLOAT32,
        )
    except Exception:
        return Validation(False, "the engine is not loaded", 0)
    rng = np.random.default_rng(0)
    took_ns = {False: 0, True: 0}
    try:
        for first, count, decode in ((0, probe_tokens, False), (probe_tokens, 1, True)):
            if role.takes_tokens:
                tokens = tuple(int(t) for t in rng.integers(0, role.vocab_size, size=count))
                hidden = None
            else:
                tokens = None
                hidden = (rng.standard_normal((count, role.hidden_size)) * 0.1).astype(np.float32)
            request = StepRequest(
                session=PROBE_SESSION,
                first_position=first,
                token_ids=tokens,
                hidden=hidden,
                expected_past_len=first if decode else None,
                sampling=GREEDY if role.is_tail else None,
                want_logits=role.is_tail,
            )
            began_ns = time.monotonic_ns()
            result = engine.decode(request) if decode else engine.prefill(request)
            took_ns[decode] = time.monotonic_ns() - began_ns
            check_result(result, role, count, sampled=role.is_tail, want_logits=role.is_tail)
    except Exception:
        return Validation(False, VALIDATION_FAILED_DETAIL, 0)
    finally:
        with contextlib.suppress(Exception):
            engine.release(PROBE_SESSION)
    return Validation(
        True,
        "",
        unix_now_ns,
        decode_ns=took_ns[True],
        prefill_ns_per_token=took_ns[False] // max(1, probe_tokens),
    )


def capability_report(
    worker: ShardWorker, request: shard.CapabilityRequest, validation: Validation | None
) -> shard.CapabilityReport:
    """What this worker executes; ``validated`` only on a passed :func:`validate_engine`."""
    caps = worker.capabilities
    detail = "not validated yet" if validation is None else validation.detail
    if request.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        detail = "requested schema version is not supported; see supported_schema_versions"
    validated = validation is not None and validation.validated
    return shard.CapabilityReport(
        schema_version=max(SUPPORTED_SCHEMA_VERSIONS),
        fingerprint=worker.fingerprint,
        shard_range=shard.ShardRange(
            start_layer=caps.layer_start, end_layer=caps.layer_end, effective_start_layer=caps.layer_start
        ),
        backend=caps.backend,
        device=caps.device,
        validated=validated,
        detail=detail,
        max_concurrent_sessions=worker.max_sessions,
        max_context_tokens=caps.max_context_tokens,
        flow_control=worker.local_flow_control,
        # The worker keeps its compressions as plain ints; the protobuf stubs type the field as the enum.
        accepted_compression=cast(list[shard.Compression], list(worker.accepted_compression)),
        supported_schema_versions=list(SUPPORTED_SCHEMA_VERSIONS),
        validated_at_unix_nanos=validation.validated_at_unix_nanos if validated and validation else 0,
    )


def health_report(worker: ShardWorker, engine_health: EngineHealth) -> shard.HealthReport:
    """Serving state and load from the worker's counts and the engine's own health."""
    load = worker.load()
    # The worker keeps its serving state as a plain int; the protobuf stubs type the field as the enum.
    state = (
        cast(shard.ServingState, worker.serving_state)
        if engine_health.loaded
        else shard.SERVING_STATE_NOT_SERVING
    )
    return shard.HealthReport(
        schema_version=max(SUPPORTED_SCHEMA_VERSIONS),
        state=state,
        active_sessions=load.active_sessions,
        queued_chunks=load.queued_units,
        batch_occupancy=load.running_units,
        kv_pressure=engine_health.kv_pressure,
        resident_bytes=engine_health.resident_bytes,
        detail="" if engine_health.loaded else "the engine is not loaded",
    )


def _check_unary(worker: ShardWorker, schema_version: int, session_id: str, epoch: int) -> None:
    if schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise refusal(shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "schema version is not supported")
    current = worker.session_epoch(session_id)
    if current is not None and epoch < current:
        raise epoch_stale(current)


def handle_release(
    worker: ShardWorker, request: shard.ReleaseRequest, now_ns: int
) -> tuple[shard.ReleaseResponse, list[Action]]:
    """Idempotent: ``released`` is False, with no error, when there was nothing to drop."""
    try:
        _check_unary(worker, request.schema_version, request.route_session_id, request.route_epoch)
    except ShardProtocolError as error:
        return shard.ReleaseResponse(released=False, error=error.to_pb()), []
    released = worker.release(request.route_session_id, request.route_epoch, now_ns)
    return shard.ReleaseResponse(released=released), worker.take_events()


def handle_cancel(
    worker: ShardWorker, request: shard.CancelRequest, now_ns: int
) -> tuple[shard.CancelResponse, list[Action]]:
    try:
        _check_unary(worker, request.schema_version, request.route_session_id, request.route_epoch)
    except ShardProtocolError as error:
        return shard.CancelResponse(cancelled_work_items=0, error=error.to_pb()), []
    count = worker.cancel(request.route_session_id, request.route_epoch, request.work_id, now_ns)
    return shard.CancelResponse(cancelled_work_items=count), worker.take_events()


UNARY_REQUESTS: dict[StreamType, type[Message]] = {
    StreamType.SHARD_CAPABILITY: shard.CapabilityRequest,
    StreamType.SHARD_HEALTH: shard.HealthRequest,
    StreamType.SHARD_RELEASE: shard.ReleaseRequest,
    StreamType.SHARD_CANCEL: shard.CancelRequest,
}


def parse_unary_request(stream_type: StreamType, body: bytes) -> Message:
    """The request message of a unary stream, or PAYLOAD_CORRUPT (close the stream unanswered)."""
    message_type = UNARY_REQUESTS.get(stream_type)
    if message_type is None:
        raise payload_corrupt("not a unary shard stream")
    message = message_type()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise payload_corrupt("unary request is not a well-formed message") from None
    return message


__all__ = [
    "PROBE_SESSION",
    "UNARY_REQUESTS",
    "Validation",
    "capability_report",
    "handle_cancel",
    "handle_release",
    "health_report",
    "parse_unary_request",
    "validate_engine",
]
