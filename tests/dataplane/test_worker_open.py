"""SessionRoute and SessionOpen: what a worker accepts, negotiates and refuses before any work."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.recording_engine import RecordingEngine

from meshnode.dataplane.actions import CloseStream
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.worker import WorkerConfig
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.pb import shard

from .harness import (
    FP,
    HIDDEN,
    NODE_B,
    WorkerHarness,
    chunk_request,
    decode_request,
    kinds,
    only_status,
    open_request,
    responses,
    result_tokens,
    srange,
)


def refused_open(harness: WorkerHarness, route: dataplane.SessionRoute | None = None, **kwargs: object):
    stream, items = harness.open(route, **kwargs)
    status = only_status(items)
    assert status.terminal
    assert any(isinstance(a, CloseStream) and a.stream_id == stream for a in harness.log)
    return status.error


def test_open_negotiates_schema_flow_control_and_compression() -> None:
    harness = WorkerHarness()
    flow = shard.FlowControl(credits_granted=16, max_inflight_chunks=3, max_chunk_bytes=4096)
    # The initiator sends the highest version it supports; the worker settles on the one it has.
    _, items = harness.open(schema=7, flow=flow)
    assert kinds(items) == ["accepted"]
    accepted = items[0].accepted
    assert accepted.schema_version == shard.SCHEMA_VERSION_1
    assert accepted.route_session_id == "s1" and accepted.route_epoch == 1
    assert accepted.flow_control.max_inflight_chunks == 3
    assert accepted.flow_control.credits_granted == 3  # capped by the in-flight ceiling
    assert accepted.flow_control.max_chunk_bytes == 4096
    assert accepted.flow_control.max_prefill_chunk_tokens == 128
    assert shard.COMPRESSION_NONE in accepted.accepted_compression
    assert accepted.fingerprint.model_artifact_digest == FP.model_artifact_digest


def test_unspecified_schema_version_is_refused() -> None:
    error = refused_open(WorkerHarness(), schema=shard.SCHEMA_VERSION_UNSPECIFIED)
    assert error.code == shard.ERROR_CODE_SCHEMA_UNSUPPORTED
    assert not error.retryable


@pytest.mark.parametrize("field", ["model_artifact_digest", "runtime_recipe_digest"])
def test_fingerprint_mismatch_is_refused(field: str) -> None:
    fingerprint = shard.Fingerprint()
    fingerprint.CopyFrom(FP)
    setattr(fingerprint, field, "sha256:other")
    error = refused_open(WorkerHarness(), fingerprint=fingerprint)
    assert error.code == shard.ERROR_CODE_FINGERPRINT_MISMATCH
    assert not error.retryable


def test_fingerprint_labels_alone_do_not_matter() -> None:
    fingerprint = shard.Fingerprint()
    fingerprint.CopyFrom(FP)
    fingerprint.recipe_id = "another label"
    _, items = WorkerHarness().open(fingerprint=fingerprint)
    assert kinds(items) == ["accepted"]


@pytest.mark.parametrize(
    "served, asked",
    [
        ((0, 2), srange(0, 3)),  # wrong end
        ((2, 4), srange(0, 4, 2)),  # wrong start
        ((0, 4), srange(0, 4, 4)),  # effective start at the end
        ((2, 4), srange(2, 4, 1)),  # effective start below the range
    ],
)
def test_shard_range_not_served_is_refused(served: tuple[int, int], asked: shard.ShardRange) -> None:
    harness = WorkerHarness(RecordingEngine(*served))
    hop = [] if served[1] == 4 else [make_hop(NODE_B, served[1], 4, served[1])]
    error = refused_open(harness, make_route(hop), shard_range=asked)
    assert error.code == shard.ERROR_CODE_SHARD_RANGE_MISMATCH
    assert not error.retryable


def test_execution_starts_at_effective_start_layer() -> None:
    # The worker serves [0, 4) but the previous hop already applied layers 0 and 1.
    harness = WorkerHarness()
    stream, items = harness.open(shard_range=srange(0, 4, 2))
    assert kinds(items) == ["accepted"]
    hidden = np.linspace(-1, 1, 3 * HIDDEN, dtype=np.float32).reshape(3, HIDDEN)
    out = harness.ask(stream, chunk_request(1, hidden, shard_range=srange(0, 4, 2)))
    assert kinds(out)[:2] == ["chunk", "ack"]
    assert harness.engine.calls[-1].effective_start_layer == 2
    assert harness.engine.calls[-1].token_ids is None

    reference = RecordingEngine(2, 4)
    from engines.interface import GREEDY, SessionKey, StepRequest

    expected = reference.prefill(
        StepRequest(session=SessionKey("x", 0), first_position=0, hidden=hidden, sampling=GREEDY)
    )
    assert result_tokens(out) == [expected.token_id]


def test_a_head_range_takes_token_ids_only() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    out = harness.ask(stream, chunk_request(1, np.zeros((2, HIDDEN), dtype=np.float32)))
    status = only_status(out)
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert not status.terminal


@pytest.mark.parametrize(
    "route, code",
    [
        (dataplane.SessionRoute(gen=2), shard.ERROR_CODE_SCHEMA_UNSUPPORTED),
        (make_route(boundary_dtype=shard.DTYPE_INT8), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (make_route(compression=7), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        # More pipeline stages than a route can have hops (meshnode.dataplane.cohorts).
        (make_route(pipeline_stages=66), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (make_route([make_hop(b"short", 2, 4, 2)]), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        # The first hop must start where this worker stops.
        (make_route([make_hop(NODE_B, 1, 4, 1)]), shard.ERROR_CODE_SHARD_RANGE_MISMATCH),
        # Hops must tile the rest of the model in order.
        (
            make_route([make_hop(NODE_B, 2, 3, 2), make_hop(NODE_B, 2, 4, 2)]),
            shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
        ),
    ],
)
def test_bad_routes_are_refused(route: dataplane.SessionRoute, code: int) -> None:
    harness = WorkerHarness(RecordingEngine(0, 2))
    error = refused_open(harness, route, shard_range=srange(0, 2))
    assert error.code == code


def test_the_tail_cannot_be_given_further_hops() -> None:
    error = refused_open(WorkerHarness(), make_route([make_hop(NODE_B, 4, 5, 4)]))
    assert error.code == shard.ERROR_CODE_SHARD_RANGE_MISMATCH


def test_bad_sampling_in_route_is_refused() -> None:
    route = make_route()
    route.sampling.temperature = -1.0
    assert refused_open(WorkerHarness(), route).code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_garbage_frame_closes_the_stream_and_the_worker_keeps_serving() -> None:
    harness = WorkerHarness()
    stream = harness.worker.open_stream()
    actions = harness.receive_frame(stream, b"\xff\xff\xff", harness.now)
    status = only_status(responses(actions, stream))
    assert status.terminal and status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert isinstance(actions[-1], CloseStream)
    # Anything later on that stream is ignored; other streams are served.
    assert harness.receive_frame(stream, make_route().SerializeToString(), harness.now) == []
    _, items = harness.open()
    assert kinds(items) == ["accepted"]


def test_work_before_open_has_no_credit() -> None:
    harness = WorkerHarness()
    stream = harness.worker.open_stream()
    harness.receive_frame(stream, make_route().SerializeToString(), harness.now)
    out = harness.ask(stream, chunk_request(1, [1, 2]))
    status = only_status(out)
    assert status.terminal and status.error.code == shard.ERROR_CODE_FLOW_CONTROL_VIOLATION
    assert harness.engine.calls == []


def test_a_second_open_on_one_stream_is_refused() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    status = only_status(harness.ask(stream, open_request()))
    assert status.terminal and status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


@pytest.mark.parametrize("session_id", ["", "x" * 200, "bad\x00id"])
def test_session_ids_must_be_short_and_printable(session_id: str) -> None:
    assert refused_open(WorkerHarness(), session_id=session_id).code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_concurrent_session_budget() -> None:
    harness = WorkerHarness(config=WorkerConfig(max_sessions=2))
    assert kinds(harness.open(session_id="a")[1]) == ["accepted"]
    assert kinds(harness.open(session_id="b")[1]) == ["accepted"]
    error = refused_open(harness, session_id="c")
    assert error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert error.retryable
    # Another stream for a session already admitted is not a new session.
    assert kinds(harness.open(session_id="a")[1]) == ["accepted"]


def test_draining_refuses_new_sessions_and_serves_existing_ones() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open(session_id="old")
    harness.ask(stream, chunk_request(1, [1, 2, 3], session_id="old"))
    harness.worker.set_serving_state(shard.SERVING_STATE_DRAINING)

    error = refused_open(harness, session_id="new")
    assert error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert error.retryable
    out = harness.ask(stream, decode_request(2, 4, 3))
    assert kinds(out)[:2] == ["chunk", "ack"]
    assert kinds(harness.open(session_id="old")[1]) == ["accepted"]


def test_open_at_an_older_epoch_is_stale() -> None:
    harness = WorkerHarness()
    harness.open(epoch=5)
    error = refused_open(harness, epoch=4)
    assert error.code == shard.ERROR_CODE_EPOCH_STALE
    assert not error.retryable


def test_same_epoch_must_keep_its_route() -> None:
    harness = WorkerHarness()
    harness.open()
    error = refused_open(harness, make_route(return_logits=True))
    assert error.code == shard.ERROR_CODE_SHARD_RANGE_MISMATCH
