"""Per-unit rules of the worker machine, each refusal with its exact ErrorCode and retryable."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers.recording_engine import RecordingEngine

from engines.fake import FaultKind, FaultRule
from engines.interface import EngineError, EngineErrorKind, SessionKey
from meshnode.dataplane.actions import CloseStream, FireCancel, Forward, ReleaseEngine, RunBatch
from meshnode.dataplane.errors import ENGINE_ERROR_TABLE, ENGINE_FAILURE_DETAIL, MALFORMED_RESULT_DETAIL
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.worker import WorkerConfig
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_tensor

from .harness import (
    HIDDEN,
    NODE_B,
    SECOND,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    kinds,
    only_status,
    responses,
    result_tokens,
    srange,
    statuses,
)


def prefilled(tokens: tuple[int, ...] = (1, 2, 3), **config: Any) -> tuple[WorkerHarness, int]:
    harness = WorkerHarness(config=WorkerConfig(**config) if config else None)
    stream, _ = harness.open()
    out = harness.ask(stream, chunk_request(1, list(tokens)))
    assert kinds(out)[:2] == ["chunk", "ack"]
    return harness, stream


def held_steps(actions: list) -> list[RunBatch]:
    return [a for a in actions if isinstance(a, RunBatch)]


# ---------------------------------------------------------------------------- deadlines


def test_deadline_passed_when_dequeued_is_not_executed() -> None:
    harness, stream = prefilled()
    first = harness.send(stream, decode_request(2, 4, 3), run=False)
    (running,) = held_steps(first)
    # Queued behind the running step, with a deadline that passes while it waits.
    queued = harness.send(stream, decode_request(3, 5, 4, deadline=harness.unix_now + SECOND), run=False)
    assert held_steps(queued) == []
    calls_before = len(harness.engine.calls)
    harness.now += 2 * SECOND
    out = responses(harness.run([running]), stream)
    assert kinds(out)[:2] == ["chunk", "ack"]  # the running step finished
    status = only_status(out)
    assert status.idempotency_step == 3
    assert status.error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
    assert not status.error.retryable
    assert not status.terminal
    assert len(harness.engine.calls) == calls_before + 1


def test_deadline_already_passed_on_arrival_is_refused() -> None:
    harness, stream = prefilled()
    calls = len(harness.engine.calls)
    status = only_status(harness.ask(stream, decode_request(2, 4, 3, deadline=harness.unix_now - 1)))
    assert status.error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
    assert len(harness.engine.calls) == calls


def test_deadline_of_a_running_unit_fires_its_cancel_token() -> None:
    harness, stream = prefilled()
    wall_clock_deadline = harness.unix_now + SECOND
    (running,) = held_steps(
        harness.send(stream, decode_request(2, 4, 3, deadline=wall_clock_deadline), run=False)
    )
    deadline = harness.now + SECOND  # the same instant on the monotonic clock
    assert harness.worker.get_timer() == deadline
    assert harness.handle_timer(deadline - 1) == []

    actions = harness.handle_timer(deadline)
    fired = [a for a in actions if isinstance(a, FireCancel)]
    assert len(fired) == 1 and fired[0].token is running.steps[0].request.cancel_token
    status = only_status(responses(actions, stream))
    assert status.error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
    assert not status.error.retryable

    # The engine honours the token; its late answer produces nothing more.
    harness.run(fired)
    assert responses(harness.run([running]), stream) == []
    # The step was not applied, so the session can take it again with a new deadline.
    out = harness.ask(stream, decode_request(2, 4, 3))
    assert kinds(out)[:2] == ["chunk", "ack"]


def test_a_running_unit_that_finishes_after_its_deadline_is_recorded_for_the_retry() -> None:
    harness, stream = prefilled()
    (running,) = held_steps(
        harness.send(stream, decode_request(2, 4, 3, deadline=harness.unix_now + 1), run=False)
    )
    harness.now += 2
    tick = harness.handle_timer(harness.now)
    assert only_status(responses(tick, stream)).error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED
    # The step races past its cancel (the FireCancel is not carried out) and completes.
    harness.run([running])
    calls = len(harness.engine.calls)
    out = harness.ask(stream, decode_request(2, 4, 3))
    assert acks(out)[0].duplicate
    assert len(harness.engine.calls) == calls
    assert len(result_tokens(out)) == 1


def test_a_wall_clock_step_moves_neither_a_deadline_already_read_nor_a_lease() -> None:
    harness, stream = prefilled()
    (running,) = held_steps(
        harness.send(stream, decode_request(2, 4, 3, deadline=harness.unix_now + 10 * SECOND), run=False)
    )
    timer = harness.worker.get_timer()
    assert timer == harness.now + 10 * SECOND
    # NTP steps the wall clock an hour ahead: the unit is not late, nor is the session idle.
    harness.wall_clock_offset += 3600 * SECOND
    assert harness.worker.get_timer() == timer
    assert harness.handle_timer(harness.now + SECOND) == []
    assert kinds(responses(harness.run([running]), stream))[:2] == ["chunk", "ack"]
    # The unit's deadline sized the session's lease to 10 s, on the monotonic clock.
    assert harness.handle_timer(harness.now + 5 * SECOND) == []
    assert harness.worker.get_timer() == harness.now + 10 * SECOND
    # A deadline that arrives after the step is read against the stepped wall clock.
    late = decode_request(3, 5, 4, deadline=harness.unix_now - 3600 * SECOND + 10 * SECOND)
    assert only_status(harness.ask(stream, late)).error.code == shard.ERROR_CODE_DEADLINE_EXCEEDED


# ---------------------------------------------------------------------------- idempotency


def test_a_duplicate_step_is_acknowledged_with_the_same_result_and_not_reapplied() -> None:
    harness, stream = prefilled()
    first = harness.ask(stream, decode_request(2, 4, 3))
    calls = len(harness.engine.calls)
    again = harness.ask(stream, decode_request(2, 4, 3))
    assert acks(first)[0].duplicate is False
    assert acks(again)[0].duplicate is True
    assert result_tokens(again) == result_tokens(first)
    assert acks(again)[0].cache_result.past_len == 4
    assert len(harness.engine.calls) == calls  # the engine ran the step once

    # KV advanced once: the next position continues normally.
    after = harness.ask(stream, decode_request(3, result_tokens(first)[0], 4))
    assert kinds(after)[:2] == ["chunk", "ack"]
    assert acks(after)[0].cache_result.past_len == 5


def test_a_duplicate_of_a_prefill_chunk_replays_its_ack() -> None:
    harness, stream = prefilled()
    calls = len(harness.engine.calls)
    again = harness.ask(stream, chunk_request(1, [1, 2, 3]))
    assert acks(again)[0].duplicate and acks(again)[0].cache_result.past_len == 3
    assert len(harness.engine.calls) == calls


def test_a_step_from_the_future_is_refused_as_a_cache_miss() -> None:
    harness, stream = prefilled()
    calls = len(harness.engine.calls)
    status = only_status(harness.ask(stream, decode_request(5, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert not status.error.retryable
    assert status.error.actual_past_len == 3
    assert len(harness.engine.calls) == calls
    # The recovery, a fresh prefill from position 0, may jump ahead.
    out = harness.ask(stream, chunk_request(9, [1, 2, 3, 4]))
    assert kinds(out)[:2] == ["chunk", "ack"]
    assert acks(harness.ask(stream, decode_request(10, 4, 4)))[0].cache_result.past_len == 5


def test_step_zero_is_unset_and_refused() -> None:
    harness, stream = prefilled()
    status = only_status(harness.ask(stream, decode_request(0, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_a_failed_step_overtaken_by_later_steps_is_refused() -> None:
    harness, stream = prefilled()
    assert only_status(harness.ask(stream, decode_request(2, 4, 9))).error.code == shard.ERROR_CODE_CACHE_MISS
    harness.ask(stream, decode_request(3, 4, 3))  # applied
    status = only_status(harness.ask(stream, decode_request(2, 4, 9)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == 4


def test_a_step_number_reused_by_other_work_is_refused() -> None:
    harness, stream = prefilled()
    harness.ask(stream, decode_request(2, 4, 3))
    status = only_status(harness.ask(stream, decode_request(2, 4, 3, work_id="other")))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert not status.error.retryable


def test_the_replay_record_is_bounded() -> None:
    harness, stream = prefilled(replay_window=2)
    for step in range(2, 6):
        harness.ask(stream, decode_request(step, 4, step + 1))
    assert acks(harness.ask(stream, decode_request(5, 4, 6)))[0].duplicate
    # Step 2 fell out of the record: it can neither be replayed nor re-applied.
    status = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS


# ---------------------------------------------------------------------------- epochs


def test_older_epoch_is_stale_and_newer_epoch_starts_fresh() -> None:
    harness, stream = prefilled()
    out = harness.ask(stream, chunk_request(1, [7, 7], epoch=2))
    # Step 1 of epoch 2 is new work, not a duplicate of epoch 1's step 1.
    assert acks(out)[0].duplicate is False
    assert acks(out)[0].cache_result.past_len == 2
    assert harness.engine.calls[-1].session == SessionKey("s1", 2)
    assert any(isinstance(a, ReleaseEngine) and a.session == SessionKey("s1", 1) for a in harness.log)
    assert harness.engine.health().active_sessions == 1  # only epoch 2's

    status = only_status(harness.ask(stream, chunk_request(3, [1], epoch=1)))
    assert status.error.code == shard.ERROR_CODE_EPOCH_STALE
    assert not status.error.retryable

    # DecodeSteps on this stream now inherit epoch 2.
    assert acks(harness.ask(stream, decode_request(2, 4, 2)))[0].cache_result.past_len == 3


def test_a_newer_epoch_abandons_the_old_epochs_queued_and_running_units() -> None:
    harness, stream = prefilled()
    old_stream = stream
    (running,) = held_steps(harness.send(old_stream, decode_request(2, 4, 3), run=False))
    harness.send(old_stream, decode_request(3, 4, 4), run=False)
    # Opening epoch 2 (on another stream) moves the session on.
    harness.log.clear()
    harness.open(epoch=2)
    stale = statuses(responses(harness.log, old_stream))
    assert [s.idempotency_step for s in stale] == [2, 3]
    assert {s.error.code for s in stale} == {shard.ERROR_CODE_EPOCH_STALE}
    assert any(
        isinstance(a, FireCancel) and a.token is running.steps[0].request.cancel_token for a in harness.log
    )
    token = running.steps[0].request.cancel_token
    assert token is not None and token.cancelled
    assert responses(harness.run([running]), old_stream) == []
    # Old stream's DecodeSteps (epoch 1) are stale from now on.
    status = only_status(harness.ask(old_stream, decode_request(4, 4, 5)))
    assert status.error.code == shard.ERROR_CODE_EPOCH_STALE


# ---------------------------------------------------------------------------- cache expectation


def test_cache_expectation_not_met_is_a_cache_miss_with_actual_length() -> None:
    harness, stream = prefilled()
    calls = len(harness.engine.calls)
    status = only_status(harness.ask(stream, decode_request(2, 4, 7)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == 3
    assert status.error.retryable is False
    assert len(harness.engine.calls) == calls


def test_cache_miss_reported_by_the_engine_carries_its_actual_length() -> None:
    harness, stream = prefilled()
    harness.engine.release(SessionKey("s1", 1))  # evicted behind the worker's back
    status = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == 0
    assert not status.error.retryable


def test_continued_prefill_chunks_must_find_the_cache_where_they_start() -> None:
    harness, stream = prefilled()
    ok = harness.ask(stream, chunk_request(2, [4, 5], first_position=3, chunk=(1, 3)))
    assert acks(ok)[0].cache_result.past_len == 5
    assert kinds(ok)[:1] == ["ack"]  # not the final chunk: nothing sampled
    status = only_status(harness.ask(stream, chunk_request(3, [6], first_position=9, chunk=(2, 3))))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == 5


# ---------------------------------------------------------------------------- flow control


def test_more_unacked_units_than_credit_is_a_flow_control_violation() -> None:
    harness = WorkerHarness()
    stream, items = harness.open()
    window = items[0].accepted.flow_control.credits_granted
    assert window == 4
    # Nothing is acknowledged while the first chunk runs and the rest queue behind it.
    for step in range(1, window + 1):
        request = chunk_request(step, [step], first_position=step - 1, chunk=(step - 1, 9))
        assert responses(harness.send(stream, request, run=False), stream) == []
    actions = harness.send(stream, chunk_request(5, [5], first_position=4, chunk=(4, 9)), run=False)
    status = only_status(responses(actions, stream))
    assert status.terminal
    assert status.error.code == shard.ERROR_CODE_FLOW_CONTROL_VIOLATION
    assert not status.error.retryable
    assert any(isinstance(a, CloseStream) for a in actions)
    # The violating stream's queued units are dropped with it.
    assert harness.worker.load().queued_units == 0


def test_acks_return_credit_and_grants_widen_the_window() -> None:
    harness, stream = prefilled()  # the prefill's ack returned its credit and granted one more
    for step in range(2, 7):  # five un-acked units now fit
        assert responses(harness.send(stream, decode_request(step, 4, step + 1), run=False), stream) == []


def test_statuses_return_credit_like_acks() -> None:
    harness, stream = prefilled()
    for step in range(2, 14):  # far more refusals than the window holds
        status = only_status(harness.ask(stream, decode_request(step, 4, 9)))
        assert status.error.code == shard.ERROR_CODE_CACHE_MISS and not status.terminal
    assert kinds(harness.ask(stream, decode_request(14, 4, 3)))[:2] == ["chunk", "ack"]


def test_a_chunk_over_max_chunk_bytes_is_a_flow_control_violation() -> None:
    harness = WorkerHarness()
    stream, items = harness.open(flow=shard.FlowControl(max_chunk_bytes=300))
    assert items[0].accepted.flow_control.max_chunk_bytes == 300
    assert kinds(harness.ask(stream, chunk_request(1, [1, 2])))[:2] == ["chunk", "ack"]
    status = only_status(harness.ask(stream, chunk_request(2, list(range(60)), first_position=2)))
    assert status.terminal
    assert status.error.code == shard.ERROR_CODE_FLOW_CONTROL_VIOLATION


def test_a_chunk_over_max_prefill_chunk_tokens_is_a_flow_control_violation() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open(flow=shard.FlowControl(max_prefill_chunk_tokens=4))
    status = only_status(harness.ask(stream, chunk_request(1, [1, 2, 3, 4, 5])))
    assert status.terminal and status.error.code == shard.ERROR_CODE_FLOW_CONTROL_VIOLATION


# ---------------------------------------------------------------------------- admission budgets


def test_positions_past_a_sessions_context_are_resource_exhausted_for_good() -> None:
    harness, stream = prefilled()
    status = only_status(harness.ask(stream, chunk_request(2, [1] * 62, first_position=3, chunk=(1, 2))))
    assert status.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert status.error.retryable is False  # the same unit can never fit


def test_node_wide_context_budget_is_resource_exhausted_and_retryable() -> None:
    harness = WorkerHarness(config=WorkerConfig(max_total_context_tokens=10))
    a, _ = harness.open(session_id="a")
    b, _ = harness.open(session_id="b")
    assert kinds(harness.ask(a, chunk_request(1, [1] * 8, session_id="a")))[:2] == ["chunk", "ack"]
    status = only_status(harness.ask(b, chunk_request(1, [1] * 3, session_id="b")))
    assert status.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert status.error.retryable is True
    harness.release("a", 1, harness.now)
    assert kinds(harness.ask(b, chunk_request(1, [1] * 3, session_id="b")))[:2] == ["chunk", "ack"]


def test_queue_depth_is_resource_exhausted_and_retryable() -> None:
    harness, stream = prefilled(max_queue_depth=2)
    harness.send(stream, decode_request(2, 4, 3), run=False)  # running
    harness.send(stream, decode_request(3, 4, 4), run=False)  # queued
    harness.send(stream, decode_request(4, 4, 5), run=False)  # queued
    status = only_status(responses(harness.send(stream, decode_request(5, 4, 6), run=False), stream))
    assert status.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert status.error.retryable is True
    assert not status.terminal


# ---------------------------------------------------------------------------- engine failures


def test_unexpected_engine_exception_is_internal_and_sanitized() -> None:
    harness, stream = prefilled()
    harness.engine.fail_next = RuntimeError("boom at /home/alice/models/secret.gguf line 3")
    status = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_INTERNAL
    assert not status.error.retryable
    assert status.error.detail == ENGINE_FAILURE_DETAIL
    assert "/" not in status.error.detail and "boom" not in status.error.detail
    # The worker keeps serving: the head recovers with a re-prefill.
    assert kinds(harness.ask(stream, chunk_request(3, [1, 2, 3, 4])))[:2] == ["chunk", "ack"]


@pytest.mark.parametrize("kind", list(EngineErrorKind))
def test_engine_error_kinds_map_through_one_table(kind: EngineErrorKind) -> None:
    harness, stream = prefilled()
    harness.engine.fail_next = EngineError(kind, "detail naming /var/lib/x", actual_past_len=2)
    status = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    code, retryable, detail = ENGINE_ERROR_TABLE[kind]
    assert status.error.code == code
    assert status.error.retryable is retryable
    assert status.error.detail == detail
    expected_actual = 2 if kind is EngineErrorKind.CACHE_MISS else 0
    assert status.error.actual_past_len == expected_actual


@pytest.mark.parametrize(
    "served, return_logits, kind",
    [
        ((0, 2), False, FaultKind.MALFORMED_NAN),
        ((0, 2), False, FaultKind.MALFORMED_SHAPE),
        ((0, 4), False, FaultKind.MALFORMED_SHAPE),  # sampled a token outside the vocabulary
        ((0, 4), True, FaultKind.MALFORMED_NAN),
        ((0, 4), True, FaultKind.MALFORMED_SHAPE),
    ],
)
def test_a_malformed_engine_result_is_internal(
    served: tuple[int, int], return_logits: bool, kind: FaultKind
) -> None:
    harness = WorkerHarness(RecordingEngine(*served))
    hops = [make_hop(NODE_B, 2, 4, 2)] if served[1] == 2 else []
    route = make_route(hops, return_logits=return_logits)
    stream, _ = harness.open(route, shard_range=srange(*served))
    harness.engine.inject(FaultRule(kind, times=1))
    status = only_status(harness.ask(stream, chunk_request(1, [1, 2], shard_range=srange(*served))))
    assert status.error.code == shard.ERROR_CODE_INTERNAL
    assert not status.error.retryable
    assert status.error.detail == MALFORMED_RESULT_DETAIL
    assert not any(isinstance(a, Forward) for a in harness.log)


def test_an_injected_engine_crash_is_internal_and_the_worker_recovers() -> None:
    harness, stream = prefilled()
    harness.engine.inject(FaultRule(FaultKind.CRASH, times=1))
    status = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    assert status.error.code == shard.ERROR_CODE_INTERNAL
    assert status.error.detail == ENGINE_FAILURE_DETAIL
    # The engine dropped the session's state after the crash: the worker reports what it finds.
    miss = only_status(harness.ask(stream, decode_request(2, 4, 3)))
    assert miss.error.code == shard.ERROR_CODE_CACHE_MISS and miss.error.actual_past_len == 0
    assert kinds(harness.ask(stream, chunk_request(3, [1, 2, 3, 4])))[:2] == ["chunk", "ack"]


# ---------------------------------------------------------------------------- payloads


def test_bad_checksum_is_payload_corrupt() -> None:
    harness, stream = prefilled()
    tensor = encode_tensor("token_ids", shard.DTYPE_INT32, np.array([4], dtype=np.int32))
    tensor.checksum.value = bytes(b ^ 0xFF for b in tensor.checksum.value)
    calls = len(harness.engine.calls)
    status = only_status(harness.ask(stream, decode_request(2, 4, 3, tensor=tensor)))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert not status.error.retryable
    assert not status.terminal
    assert len(harness.engine.calls) == calls
    # Not applied: the step can be sent again, intact.
    assert kinds(harness.ask(stream, decode_request(2, 4, 3)))[:2] == ["chunk", "ack"]


@pytest.mark.parametrize(
    "tensor",
    [
        encode_tensor("hidden_states", shard.DTYPE_INT32, np.array([4], dtype=np.int32)),  # wrong name
        encode_tensor("token_ids", shard.DTYPE_INT64, np.array([4], dtype=np.int64)),  # wrong dtype
        encode_tensor("token_ids", shard.DTYPE_INT32, np.array([4, 5], dtype=np.int32)),  # two tokens
        encode_tensor("token_ids", shard.DTYPE_INT32, np.array([999], dtype=np.int32)),  # outside vocab
        encode_tensor("token_ids", shard.DTYPE_INT32, np.array([-1], dtype=np.int32)),
    ],
)
def test_wrong_tensor_for_the_role_is_payload_corrupt(tensor: shard.NamedTensor) -> None:
    harness, stream = prefilled()
    status = only_status(harness.ask(stream, decode_request(2, 4, 3, tensor=tensor)))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_hidden_size_mismatch_is_payload_corrupt() -> None:
    harness = WorkerHarness(RecordingEngine(2, 4))
    stream, _ = harness.open(shard_range=srange(2, 4))
    wrong = np.zeros((2, HIDDEN + 1), dtype=np.float32)
    status = only_status(harness.ask(stream, chunk_request(1, wrong, shard_range=srange(2, 4))))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    nan = np.full((2, HIDDEN), np.inf, dtype=np.float32)
    status = only_status(harness.ask(stream, chunk_request(1, nan, shard_range=srange(2, 4))))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_compression_not_agreed_is_payload_corrupt() -> None:
    harness = WorkerHarness(config=WorkerConfig(accepted_compression=(shard.COMPRESSION_NONE,)))
    stream, items = harness.open()
    assert list(items[0].accepted.accepted_compression) == [shard.COMPRESSION_NONE]
    tensor = encode_tensor(
        "token_ids", shard.DTYPE_INT32, np.array([1, 2], dtype=np.int32), compression=shard.COMPRESSION_ZSTD
    )
    status = only_status(harness.ask(stream, chunk_request(1, None, tensor=tensor)))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


@pytest.mark.parametrize(
    "mutate, code",
    [
        (lambda env: setattr(env, "schema_version", 2), shard.ERROR_CODE_SCHEMA_UNSUPPORTED),
        (
            lambda env: setattr(env.fingerprint, "runtime_recipe_digest", "x"),
            shard.ERROR_CODE_FINGERPRINT_MISMATCH,
        ),
        (
            lambda env: setattr(env.shard_range, "effective_start_layer", 1),
            shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
        ),
        (lambda env: setattr(env, "route_session_id", "s2"), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (lambda env: setattr(env, "phase", shard.PHASE_CANCEL), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (lambda env: env.cache_expectation.Clear(), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (lambda env: setattr(env.chunk, "final_chunk", False), shard.ERROR_CODE_PAYLOAD_CORRUPT),
        (lambda env: setattr(env.position, "first_position", 2), shard.ERROR_CODE_PAYLOAD_CORRUPT),
    ],
)
def test_every_envelope_field_is_enforced(mutate, code: int) -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    request = chunk_request(1, [1, 2])
    mutate(request.chunk.envelope)
    status = only_status(harness.ask(stream, request))
    assert status.error.code == code
    assert not status.terminal
    assert harness.engine.calls == []


# ---------------------------------------------------------------------------- cancel and release


def test_in_band_cancel_abandons_running_and_queued_units() -> None:
    harness, stream = prefilled()
    (running,) = held_steps(harness.send(stream, decode_request(2, 4, 3), run=False))
    harness.send(stream, decode_request(3, 4, 4), run=False)
    harness.send(stream, decode_request(4, 4, 5), run=False)
    cancel = shard.SessionRequest(cancel=shard.CancelSignal(route_session_id="s1", route_epoch=1))
    actions = harness.send(stream, cancel, run=False)
    cancelled = statuses(responses(actions, stream))
    assert [s.idempotency_step for s in cancelled] == [2, 3, 4]
    assert all(s.error.code == shard.ERROR_CODE_CANCELLED and not s.error.retryable for s in cancelled)
    assert [a.token for a in actions if isinstance(a, FireCancel)] == [running.steps[0].request.cancel_token]
    calls = len(harness.engine.calls)
    harness.run([a for a in actions if isinstance(a, FireCancel)])
    assert responses(harness.run([running]), stream) == []
    assert len(harness.engine.calls) == calls + 1  # only the running one reached the engine
    assert harness.worker.load().queued_units == 0


def test_cancel_of_one_work_id_leaves_the_others() -> None:
    harness, stream = prefilled()
    (running,) = held_steps(harness.send(stream, decode_request(2, 4, 3), run=False))
    harness.send(stream, decode_request(3, 4, 4), run=False)
    count, actions = harness.cancel("s1", 1, "w3", harness.now)
    assert count == 1
    assert only_status(responses(actions, stream)).idempotency_step == 3
    assert not any(isinstance(a, FireCancel) for a in actions)
    assert kinds(responses(harness.run([running]), stream))[:2] == ["chunk", "ack"]


def test_in_band_release_drops_engine_state_and_is_idempotent() -> None:
    harness, stream = prefilled()
    release = shard.SessionRequest(release=shard.ReleaseSignal(route_session_id="s1", route_epoch=1))
    actions = harness.send(stream, release)
    assert [a.session for a in actions if isinstance(a, ReleaseEngine)] == [SessionKey("s1", 1)]
    assert harness.engine.health().active_sessions == 0
    assert harness.worker.load().active_sessions == 0
    assert harness.send(stream, release) == []
    # The stream stays usable: without state a decode misses, a prefill starts over.
    assert only_status(harness.ask(stream, decode_request(2, 4, 3))).error.code == shard.ERROR_CODE_CACHE_MISS
    assert kinds(harness.ask(stream, chunk_request(3, [1, 2])))[:2] == ["chunk", "ack"]


def test_signals_naming_another_session_are_refused() -> None:
    harness, stream = prefilled()
    cancel = shard.SessionRequest(cancel=shard.CancelSignal(route_session_id="other", route_epoch=1))
    status = only_status(harness.ask(stream, cancel))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT and not status.terminal


# ---------------------------------------------------------------------------- streams, scheduling, time


def test_closing_a_stream_drops_its_queued_units_and_a_retry_runs_them() -> None:
    harness, stream = prefilled()
    (running,) = held_steps(harness.send(stream, decode_request(2, 4, 3), run=False))
    harness.send(stream, decode_request(3, 4, 4), run=False)
    harness.stream_closed(stream, harness.now)
    assert harness.worker.load().queued_units == 0
    harness.run([running])  # applied and recorded; its answer had nowhere to go

    again, _ = harness.open()
    replay = harness.ask(again, decode_request(2, 4, 3))
    assert acks(replay)[0].duplicate and len(result_tokens(replay)) == 1
    fresh = harness.ask(again, decode_request(3, 4, 4))
    assert acks(fresh)[0].duplicate is False


def test_another_sessions_decode_rides_along_with_the_next_prefill_chunk() -> None:
    harness = WorkerHarness()
    a, _ = harness.open(session_id="a")
    b, _ = harness.open(session_id="b")
    harness.ask(b, chunk_request(1, [1, 2], session_id="b"))
    (running,) = held_steps(harness.send(a, chunk_request(1, [1, 2], session_id="a"), run=False))
    harness.send(a, chunk_request(2, [3, 4], session_id="a", first_position=2, chunk=(1, 2)), run=False)
    harness.send(b, decode_request(2, 4, 2), run=False)
    harness.run([running])
    # b's decode did not wait for a's prompt to finish: it ran in the batch with a's next chunk.
    batches = [
        [(s.request.session.session_id, s.request.first_position, s.decode) for s in batch]
        for batch in harness.engine.batches[-2:]
    ]
    assert batches == [[("a", 0, False)], [("a", 2, False), ("b", 2, True)]]


def test_idle_sessions_expire() -> None:
    ttl = 10 * SECOND
    harness, _ = prefilled(session_idle_ttl_ns=ttl)
    assert harness.worker.get_timer() == harness.now + ttl
    actions = harness.handle_timer(harness.now + ttl)
    assert [a.session for a in actions if isinstance(a, ReleaseEngine)] == [SessionKey("s1", 1)]
    assert harness.worker.load().active_sessions == 0
    assert harness.worker.get_timer() is None


def test_stateless_cache_mode_runs_as_a_fresh_prefill() -> None:
    harness = WorkerHarness()
    stream, _ = harness.open()
    request = chunk_request(1, [1, 2, 3])
    request.chunk.envelope.cache_expectation.mode = shard.CACHE_MODE_STATELESS
    out = harness.ask(stream, request)
    assert acks(out)[0].cache_result.past_len == 3
    late = chunk_request(2, [4], first_position=3, chunk=(1, 2))
    late.chunk.envelope.cache_expectation.mode = shard.CACHE_MODE_STATELESS
    assert only_status(harness.ask(stream, late)).error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_an_activation_chunk_reaches_the_engine_without_a_copy_of_its_payload() -> None:
    harness = WorkerHarness(RecordingEngine(2, 4))
    stream, _ = harness.open(shard_range=srange(2, 4))
    hidden = np.arange(3 * HIDDEN, dtype=np.float32).reshape(3, HIDDEN)
    body = chunk_request(1, hidden, shard_range=srange(2, 4)).SerializeToString()
    (run,) = held_steps(harness.receive_frame(stream, body, harness.now))
    assert np.array_equal(run.steps[0].request.hidden, hidden)
    assert np.shares_memory(run.steps[0].request.hidden, np.frombuffer(body, np.uint8))


def test_a_chunk_encoded_unusually_is_answered_like_the_canonical_one() -> None:
    # An unknown field makes the in-place reader step aside; protobuf parses it instead.
    hidden = np.linspace(-1, 1, 2 * HIDDEN, dtype=np.float32).reshape(2, HIDDEN)
    answers = []
    for suffix in (b"", b"\x78\x01"):  # field 15, varint: unknown to SessionRequest
        harness = WorkerHarness(RecordingEngine(2, 4))
        stream, _ = harness.open(shard_range=srange(2, 4))
        body = chunk_request(1, hidden, shard_range=srange(2, 4)).SerializeToString() + suffix
        out = responses(harness.run(harness.receive_frame(stream, body, harness.now)), stream)
        assert kinds(out)[:2] == ["chunk", "ack"]
        (call,) = harness.engine.calls
        for response in out:
            if response.WhichOneof("kind") == "ack":
                response.ack.ClearField("execution_nanos")  # a timing, not an answer
        answers.append(([r.SerializeToString(deterministic=True) for r in out], call.hidden.tobytes()))
    assert answers[0] == answers[1]
    assert answers[0][1] == hidden.tobytes()
