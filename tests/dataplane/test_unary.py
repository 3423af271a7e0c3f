"""GetCapability, Health, Release and Cancel on their own streams."""

from __future__ import annotations

import pytest
from helpers.recording_engine import RecordingEngine

from engines.fake import FaultKind, FaultRule
from engines.interface import EngineError, EngineErrorKind
from meshnode.dataplane.actions import FireCancel, ReleaseEngine, RunBatch
from meshnode.dataplane.unary import (
    PROBE_SESSION,
    VALIDATION_FAILED_DETAIL,
    capability_report,
    handle_cancel,
    handle_release,
    health_report,
    parse_unary_request,
    validate_engine,
)
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import shard

from .harness import WorkerHarness, chunk_request, decode_request, only_status, responses, statuses

V1 = shard.SCHEMA_VERSION_1
# A wall-clock instant, apart from the harness's monotonic clock.
UNIX_NOW_NS = 1_800_000_000 * 10**9


@pytest.mark.parametrize("served", [(0, 4), (0, 2), (2, 4), (1, 3)])
def test_capability_is_validated_only_after_a_real_bounded_forward(served: tuple[int, int]) -> None:
    harness = WorkerHarness(RecordingEngine(*served))
    before = capability_report(harness.worker, shard.CapabilityRequest(schema_version=V1), None)
    assert not before.validated and before.validated_at_unix_nanos == 0

    validation = validate_engine(harness.engine, unix_now_ns=UNIX_NOW_NS)
    assert validation.validated
    assert len(harness.engine.calls) == 2  # a prefill and one decode step
    assert all(c.session == PROBE_SESSION for c in harness.engine.calls)
    assert PROBE_SESSION in harness.engine.released and harness.engine.health().active_sessions == 0

    report = capability_report(harness.worker, shard.CapabilityRequest(schema_version=V1), validation)
    assert report.validated and report.validated_at_unix_nanos == UNIX_NOW_NS
    assert (report.shard_range.start_layer, report.shard_range.end_layer) == served
    assert report.fingerprint.model_artifact_digest == harness.worker.fingerprint.model_artifact_digest
    assert report.max_concurrent_sessions == 4 and report.max_context_tokens == 64
    assert list(report.supported_schema_versions) == [V1]
    assert report.flow_control.max_inflight_chunks == 8


@pytest.mark.parametrize(
    "fault",
    [
        RuntimeError("/opt/models/x.gguf: bad magic"),
        EngineError(EngineErrorKind.INTERNAL, "ggml abort"),
    ],
)
def test_a_failing_forward_leaves_the_capability_unvalidated_with_a_fixed_detail(fault: Exception) -> None:
    engine = RecordingEngine()
    engine.fail_next = fault
    validation = validate_engine(engine, unix_now_ns=UNIX_NOW_NS)
    assert not validation.validated and validation.detail == VALIDATION_FAILED_DETAIL
    assert PROBE_SESSION in engine.released
    report = capability_report(
        WorkerHarness(engine).worker, shard.CapabilityRequest(schema_version=V1), validation
    )
    assert not report.validated and report.detail == VALIDATION_FAILED_DETAIL


@pytest.mark.parametrize("served", [(0, 2), (2, 4)])
@pytest.mark.parametrize("kind", [FaultKind.MALFORMED_NAN, FaultKind.MALFORMED_SHAPE])
def test_non_finite_or_misshapen_outputs_do_not_validate(served: tuple[int, int], kind: FaultKind) -> None:
    engine = RecordingEngine(*served)
    assert validate_engine(engine, unix_now_ns=UNIX_NOW_NS).validated
    engine.inject(FaultRule(kind, times=1))
    validation = validate_engine(engine, unix_now_ns=UNIX_NOW_NS)
    assert not validation.validated and validation.detail == VALIDATION_FAILED_DETAIL
    assert validate_engine(engine, unix_now_ns=UNIX_NOW_NS).validated  # the fault fired once


def test_health_reports_engine_state_and_worker_load() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    harness.ask(stream, chunk_request(1, [1, 2, 3]))
    harness.send(stream, decode_request(2, 4, 3), run=False)
    harness.send(stream, decode_request(3, 4, 4), run=False)
    report = health_report(harness.worker, harness.engine.health())
    assert report.state == shard.SERVING_STATE_SERVING
    assert report.active_sessions == 1
    assert report.queued_chunks == 1
    assert report.batch_occupancy == 1
    engine_health = harness.engine.health()
    assert engine_health.kv_tokens_used == 3
    assert report.kv_pressure == pytest.approx(3 / 256)
    assert report.resident_bytes == engine_health.resident_bytes > 0

    harness.worker.set_serving_state(shard.SERVING_STATE_DRAINING)
    assert health_report(harness.worker, harness.engine.health()).state == shard.SERVING_STATE_DRAINING


def test_an_unloaded_engine_is_not_serving() -> None:
    from engines.interface import EngineHealth

    harness = WorkerHarness()
    report = health_report(harness.worker, EngineHealth(False, 0, 0, 0, 0))
    assert report.state == shard.SERVING_STATE_NOT_SERVING


def test_unary_cancel_reaches_units_of_a_wedged_stream() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    harness.ask(stream, chunk_request(1, [1, 2, 3]))
    actions = harness.send(stream, decode_request(2, 4, 3), run=False)
    (running,) = [a for a in actions if isinstance(a, RunBatch)]
    harness.send(stream, decode_request(3, 4, 4), run=False)

    request = shard.CancelRequest(schema_version=V1, route_session_id="s1", route_epoch=1, reason="user")
    response, actions = handle_cancel(harness.worker, request, harness.now)
    assert response.cancelled_work_items == 2
    assert response.error.code == shard.ERROR_CODE_UNSPECIFIED
    assert [s.error.code for s in statuses(responses(actions, stream))] == [shard.ERROR_CODE_CANCELLED] * 2
    assert [a.token for a in actions if isinstance(a, FireCancel)] == [running.steps[0].request.cancel_token]

    again, _ = handle_cancel(harness.worker, request, harness.now)
    assert again.cancelled_work_items == 0


def test_unary_cancel_and_release_refuse_stale_epochs_and_unknown_schema() -> None:
    harness = WorkerHarness()
    harness.open(epoch=3)
    stale = shard.CancelRequest(schema_version=V1, route_session_id="s1", route_epoch=2)
    response, actions = handle_cancel(harness.worker, stale, harness.now)
    assert response.error.code == shard.ERROR_CODE_EPOCH_STALE and actions == []
    release, _ = handle_release(
        harness.worker,
        shard.ReleaseRequest(schema_version=V1, route_session_id="s1", route_epoch=2),
        harness.now,
    )
    assert not release.released and release.error.code == shard.ERROR_CODE_EPOCH_STALE
    unspecified, _ = handle_cancel(harness.worker, shard.CancelRequest(route_session_id="s1"), harness.now)
    assert unspecified.error.code == shard.ERROR_CODE_SCHEMA_UNSUPPORTED
    unknown, _ = handle_cancel(
        harness.worker, shard.CancelRequest(schema_version=V1, route_session_id="nobody"), harness.now
    )
    assert unknown.cancelled_work_items == 0 and unknown.error.code == shard.ERROR_CODE_UNSPECIFIED


def test_unary_release_is_idempotent() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    harness.ask(stream, chunk_request(1, [1, 2, 3]))
    request = shard.ReleaseRequest(schema_version=V1, route_session_id="s1", route_epoch=1)
    first, actions = handle_release(harness.worker, request, harness.now)
    assert first.released and first.error.code == shard.ERROR_CODE_UNSPECIFIED
    assert [a for a in actions if isinstance(a, ReleaseEngine)]
    second, actions = handle_release(harness.worker, request, harness.now)
    assert not second.released and second.error.code == shard.ERROR_CODE_UNSPECIFIED
    assert actions == []
    never, _ = handle_release(
        harness.worker,
        shard.ReleaseRequest(schema_version=V1, route_session_id="x", route_epoch=1),
        harness.now,
    )
    assert not never.released


def test_release_cancels_the_sessions_units_in_flight() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    harness.ask(stream, chunk_request(1, [1, 2, 3]))
    harness.send(stream, decode_request(2, 4, 3), run=False)
    request = shard.ReleaseRequest(schema_version=V1, route_session_id="s1", route_epoch=1)
    response, actions = handle_release(harness.worker, request, harness.now)
    assert response.released
    assert only_status(responses(actions, stream)).error.code == shard.ERROR_CODE_CANCELLED


def test_unary_requests_parse_or_are_payload_corrupt() -> None:
    body = shard.HealthRequest(schema_version=V1).SerializeToString()
    assert parse_unary_request(StreamType.SHARD_HEALTH, body) == shard.HealthRequest(schema_version=V1)
    with pytest.raises(ShardProtocolError) as info:
        parse_unary_request(StreamType.SHARD_CANCEL, b"\x0a\xff")
    assert info.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    with pytest.raises(ShardProtocolError):
        parse_unary_request(StreamType.GOSSIP, b"")
