"""SessionClient against a real ShardWorker, in process, through serialized frames."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.recording_engine import RecordingEngine

from meshnode.dataplane.client import (
    ClientConfig,
    SessionFailed,
    SessionNotReady,
    SessionReady,
    UnitDone,
    UnitFailed,
)
from meshnode.dataplane.errors import SessionTransportError
from meshnode.dataplane.route import make_route
from meshnode.dataplane.unary import handle_cancel
from meshnode.dataplane.worker import WorkerConfig
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

from .harness import FP, HIDDEN, SECOND, Loopback, WorkerHarness, make_client, reference, srange


def connected(
    chunk_tokens: int = 128, harness: WorkerHarness | None = None, **client_kwargs: object
) -> Loopback:
    flow = shard.FlowControl(max_prefill_chunk_tokens=chunk_tokens)
    config = client_kwargs.pop("config", None) or ClientConfig(proposed_flow_control=flow)
    link = Loopback(harness or WorkerHarness(), make_client(config=config, **client_kwargs))
    link.connect()
    events = link.client.take_events()
    assert [type(e) for e in events] == [SessionReady]
    return link


def token_of(event: object) -> int:
    assert isinstance(event, UnitDone), event
    return int(event.tensors()["token_ids"].array[0])


def generate(link: Loopback, prompt: list[int], decode_steps: int) -> list[int]:
    ids = link.client.submit_prefill(prompt)
    link.pump()
    done = link.client.take_events()
    assert [e.unit_id for e in done] == ids
    tokens = [token_of(done[-1])]
    position = len(prompt)
    for _ in range(decode_steps):
        link.client.submit_decode(tokens[-1], position=position)
        link.pump()
        (event,) = link.client.take_events()
        tokens.append(token_of(event))
        position += 1
    return tokens


def test_chunked_prefill_and_decode_match_the_whole_model() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    link = connected(chunk_tokens=3)
    assert generate(link, prompt, 10) == reference(prompt, 10)
    prefills = [c for c in link.harness.engine.calls if c.expected_past_len is None]
    assert [c.n_tokens for c in prefills] == [3, 3, 2]


def test_credits_are_respected_while_units_pipeline() -> None:
    link = connected(chunk_tokens=1)
    client = link.client
    link.hold_engine = True
    client.submit_prefill(list(range(10)))
    assert client.window == 4
    sent = client.requests_to_send(link.harness.now)
    assert len(sent) == 4  # four units in flight before any answer: pipelined
    assert client.unacked == 4 and client.pending == 6
    assert client.requests_to_send(link.harness.now) == []  # blocked on credit
    for body in sent:
        link.deliver(body)
    most_in_flight = client.unacked
    done = 0
    while done < 10:
        link.release_held()
        link.hold_engine = True
        done += sum(isinstance(e, UnitDone) for e in client.take_events())
        assert client.unacked <= client.window <= 8
        while bodies := client.requests_to_send(link.harness.now):
            for body in bodies:
                link.deliver(body)
            most_in_flight = max(most_in_flight, client.unacked)
            assert client.unacked <= client.window
    assert most_in_flight > 4  # the worker's grants widened the window
    assert not any(isinstance(e, UnitFailed) for e in client.take_events())


def test_a_retry_after_a_transport_error_sends_the_same_step_and_is_a_duplicate() -> None:
    prompt = [2, 7, 1, 8]
    link = connected()
    expected = reference(prompt, 2)
    assert generate(link, prompt, 0) == expected[:1]

    sent_bodies: list[bytes] = []
    deliver = link.deliver

    def record_then_deliver(body: bytes) -> None:
        sent_bodies.append(body)
        deliver(body)

    link.deliver = record_then_deliver  # type: ignore[method-assign]  # records what the client sends
    link.hold_engine = True
    link.client.submit_decode(expected[0], position=len(prompt))
    link.pump()
    assert len(link.held) == 1 and link.client.take_events() == []

    link.lose_stream()
    link.release_held()  # the step completes on the worker; its answer has nowhere to go
    calls = len(link.harness.engine.calls)
    link.connect()
    link.pump()
    events = link.client.take_events()
    assert isinstance(events[0], SessionReady)
    (done,) = events[1:]
    assert isinstance(done, UnitDone) and done.duplicate
    assert token_of(done) == expected[1]
    assert len(link.harness.engine.calls) == calls  # applied once
    route_open, retry_body = sent_bodies[-3], sent_bodies[-1]
    assert retry_body == sent_bodies[0] and route_open != retry_body

    link.client.submit_decode(expected[1], position=len(prompt) + 1)
    link.pump()
    assert token_of(link.client.take_events()[0]) == expected[2]


def test_a_retry_runs_units_the_worker_never_applied() -> None:
    prompt = list(range(1, 10))
    link = connected(chunk_tokens=3)
    link.hold_engine = True
    link.client.submit_prefill(prompt)
    link.pump()
    link.lose_stream()  # chunk 0 is running, chunks 1 and 2 were queued and are dropped
    link.release_held()
    link.connect()
    link.pump()
    done = [e for e in link.client.take_events() if isinstance(e, UnitDone)]
    assert [e.duplicate for e in done] == [True, False, False]
    assert token_of(done[-1]) == reference(prompt, 0)[0]


def test_units_fail_with_a_transport_error_after_max_attempts() -> None:
    link = connected(config=ClientConfig(max_attempts=1))
    link.client.submit_prefill([1, 2])
    link.hold_engine = True
    link.pump()
    link.lose_stream()
    (failed,) = link.client.take_events()
    assert isinstance(failed, UnitFailed) and isinstance(failed.error, SessionTransportError)
    link.release_held()  # it did run on the worker
    # The caller can still send it again, as the same step: the worker knows it as applied.
    link.connect()
    link.client.take_events()
    link.client.retry(failed.unit_id)
    link.pump()
    (done,) = link.client.take_events()
    assert isinstance(done, UnitDone) and done.step == failed.step and done.duplicate
    assert len(link.harness.engine.calls) == 1


def test_a_refused_open_surfaces_typed_errors_for_every_unit() -> None:
    other = shard.Fingerprint()
    other.CopyFrom(FP)
    other.model_artifact_digest = "sha256:elsewhere"
    link = Loopback(WorkerHarness(), make_client())
    link.client.fingerprint = other
    link.client.submit_decode(4, position=3)
    link.connect()
    events = link.client.take_events()
    assert [type(e) for e in events] == [UnitFailed, SessionFailed]
    for event in events:
        assert isinstance(event.error, ShardProtocolError)
        assert event.error.code == shard.ERROR_CODE_FINGERPRINT_MISMATCH
        assert event.error.retryable is False
    with pytest.raises(SessionNotReady):
        link.client.submit_decode(4, position=3)


def test_refusals_of_units_surface_as_typed_errors() -> None:
    link = connected()
    generate(link, [1, 2, 3], 0)
    link.client.submit_decode(5, position=9)
    link.pump()
    (failed,) = link.client.take_events()
    assert isinstance(failed, UnitFailed)
    assert isinstance(failed.error, ShardProtocolError)
    assert failed.error.code == shard.ERROR_CODE_CACHE_MISS
    assert failed.error.actual_past_len == 3 and not failed.error.retryable
    assert link.client.unacked == 0


def test_a_wedged_peer_fails_units_at_their_deadline() -> None:
    link = connected()
    deadline = link.harness.now + SECOND
    link.hold_engine = True
    link.client.submit_prefill([1, 2], deadline=link.harness.deadline(SECOND))
    link.pump()
    assert link.client.get_timer() == deadline
    link.client.handle_timer(deadline - 1)
    assert link.client.take_events() == []
    link.client.handle_timer(deadline)
    (failed,) = link.client.take_events()
    assert isinstance(failed.error, SessionTransportError)
    assert link.client.get_timer() is None
    # The late answer returns the credit and nothing else.
    link.release_held()
    assert link.client.take_events() == [] and link.client.unacked == 0


def test_each_prefill_chunk_has_its_allowance_after_the_one_before() -> None:
    """A wide model's prefill chunk takes tens of seconds: a prompt's chunks sharing one unit's
    deadline expired mid-prompt (issue 53), so each waits its allowance after the one before."""
    link = connected(chunk_tokens=2)
    start = link.harness.now
    link.hold_engine = True
    ids = link.client.submit_prefill(
        [1, 2, 3, 4, 5, 6], deadline=link.harness.deadline(SECOND), chunk_allowance_ns=SECOND
    )
    assert len(ids) == 3
    link.pump()
    for index, unit_id in enumerate(ids):
        deadline = start + (index + 1) * SECOND
        assert link.client.get_timer() == deadline
        link.client.handle_timer(deadline - 1)
        assert link.client.take_events() == []
        link.client.handle_timer(deadline)
        (failed,) = link.client.take_events()
        assert failed.unit_id == unit_id and isinstance(failed.error, SessionTransportError)
    assert link.client.get_timer() is None


def test_cancel_reaches_a_sender_blocked_on_credit() -> None:
    link = connected(chunk_tokens=1)
    link.hold_engine = True
    link.client.submit_prefill(list(range(10)))
    link.pump()
    assert link.client.pending == 6  # blocked: the window is full
    request = link.client.cancel_request(reason="user stopped")
    local = link.client.take_events()
    assert len(local) == 6
    assert all(isinstance(e, UnitFailed) and e.error.code == shard.ERROR_CODE_CANCELLED for e in local)

    response, actions = handle_cancel(link.harness.worker, request, link.harness.now)
    assert response.cancelled_work_items == 4
    link.feed(actions)
    remote = link.client.take_events()
    assert len(remote) == 4 and all(e.error.code == shard.ERROR_CODE_CANCELLED for e in remote)
    assert link.client.unacked == 0 and link.client.pending == 0


def test_in_band_cancel_and_release() -> None:
    link = connected()
    generate(link, [1, 2, 3], 0)
    link.deliver(link.client.release_signal())
    assert link.harness.worker.load().active_sessions == 0
    link.hold_engine = True
    link.client.submit_prefill([4, 5])
    link.pump()
    link.deliver(link.client.cancel_signal())
    (failed,) = link.client.take_events()
    assert failed.error.code == shard.ERROR_CODE_CANCELLED


def test_peer_protocol_violations_raise_payload_corrupt() -> None:
    link = connected()
    stray = shard.SessionResponse(ack=shard.Ack(idempotency_step=77))
    with pytest.raises(ShardProtocolError) as info:
        link.client.receive_response(stray)
    assert info.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    with pytest.raises(ShardProtocolError):
        link.client.receive_frame(b"\x1a\xff")
    fresh = make_client()
    fresh.start_stream()
    with pytest.raises(ShardProtocolError):
        fresh.receive_response(shard.SessionResponse(flow_control=shard.FlowControl(credits_granted=1)))


def test_prefill_planning_needs_the_negotiated_limits() -> None:
    with pytest.raises(SessionNotReady):
        make_client().submit_prefill([1, 2, 3])


@pytest.mark.parametrize("worker_takes_zstd", [True, False])
def test_activations_use_the_route_compression_only_when_the_peer_accepts_it(worker_takes_zstd: bool) -> None:
    accepted = (
        (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD) if worker_takes_zstd else (shard.COMPRESSION_NONE,)
    )
    harness = WorkerHarness(RecordingEngine(2, 4), WorkerConfig(accepted_compression=accepted))
    link = connected(
        harness=harness,
        shard_range=srange(2, 4),
        route=make_route(compression=shard.COMPRESSION_ZSTD),
    )
    hidden = np.linspace(-1, 1, 4 * HIDDEN, dtype=np.float32).reshape(4, HIDDEN)
    link.client.submit_prefill(hidden)
    (body,) = link.client.requests_to_send(link.harness.now)
    request = shard.SessionRequest()
    request.ParseFromString(body)
    expected = shard.COMPRESSION_ZSTD if worker_takes_zstd else shard.COMPRESSION_NONE
    assert request.chunk.bundle.tensors[0].compression == expected
    link.deliver(body)
    (done,) = link.client.take_events()
    assert isinstance(done, UnitDone)
    np.testing.assert_array_equal(harness.engine.calls[-1].hidden, hidden)
