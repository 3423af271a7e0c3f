"""Two workers in a daisy chain: the head forwards activations to the tail and relays its answer."""

from __future__ import annotations

import numpy as np
from helpers.recording_engine import RecordingEngine
from helpers.step_results import sampled_token, step_logits

from engines.interface import GREEDY, EngineError, EngineErrorKind, SessionKey, StepRequest
from meshnode.dataplane.actions import CancelDownstream, Forward, ReleaseDownstream, ReleaseEngine
from meshnode.dataplane.client import ClientConfig, SessionReady, UnitDone, UnitFailed
from meshnode.dataplane.envelope import Deadline, UnitPosition
from meshnode.dataplane.errors import SessionTransportError
from meshnode.dataplane.route import make_hop, make_route
from meshnode.dataplane.worker import DownstreamResult
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle

from .harness import (
    NODE_B,
    SECOND,
    Chain,
    Loopback,
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    kinds,
    make_client,
    only_status,
    reference,
    responses,
    result_tokens,
    srange,
)


def reference_logits(prompt: list[int], decode_steps: int) -> list[np.ndarray]:
    engine = RecordingEngine()
    key = SessionKey("reference", 0)
    result = engine.prefill(
        StepRequest(session=key, first_position=0, token_ids=tuple(prompt), sampling=GREEDY, want_logits=True)
    )
    logits = [step_logits(result)]
    position = len(prompt)
    for _ in range(decode_steps):
        result = engine.decode(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=(sampled_token(result),),
                expected_past_len=position,
                sampling=GREEDY,
                want_logits=True,
            )
        )
        logits.append(step_logits(result))
        position += 1
    return logits


def head_link(chain: Chain, chunk_tokens: int = 3) -> Loopback:
    config = ClientConfig(proposed_flow_control=shard.FlowControl(max_prefill_chunk_tokens=chunk_tokens))
    link = Loopback(chain.head, make_client(srange(0, 2), chain.route, config=config))
    link.connect()
    assert [type(e) for e in link.client.take_events()] == [SessionReady]
    return link


def run_generation(link: Loopback, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    link.client.submit_prefill(prompt)
    link.pump()
    done = link.client.take_events()
    assert all(isinstance(e, UnitDone) for e in done), done
    outputs = [done[-1].tensors()]
    position = len(prompt)
    for _ in range(steps):
        link.client.submit_decode(int(outputs[-1]["token_ids"].array[0]), position=position)
        link.pump()
        (event,) = link.client.take_events()
        assert isinstance(event, UnitDone), event
        outputs.append(event.tensors())
        position += 1
    tokens = [int(o["token_ids"].array[0]) for o in outputs]
    logits = [o["logits"].array for o in outputs if "logits" in o]
    return tokens, logits


def test_a_split_chain_is_bit_identical_to_the_whole_model() -> None:
    prompt = [5, 3, 8, 1, 9, 2, 7]
    chain = Chain(route_kwargs={"return_logits": True})
    tokens, logits = run_generation(head_link(chain), prompt, 20)
    assert tokens == reference(prompt, 20)
    expected = reference_logits(prompt, 20)
    assert len(logits) == len(expected) == 21
    for got, want in zip(logits, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    # Three prefill chunks and twenty steps crossed the boundary; nothing else did.
    assert chain.forwards == 3 + 20
    assert [c.effective_start_layer for c in chain.tail.engine.calls] == [2] * 23


def test_a_bfloat16_boundary_stays_close_and_really_rounds() -> None:
    prompt = [5, 3, 8, 1, 9, 2, 7]
    chain = Chain(route_kwargs={"return_logits": True, "boundary_dtype": shard.DTYPE_BFLOAT16})
    tokens, logits = run_generation(head_link(chain), prompt, 20)
    expected_tokens = reference(prompt, 20)
    agreement = sum(a == b for a, b in zip(tokens, expected_tokens, strict=True)) / len(tokens)
    # Every hidden state reached the tail as bfloat16 values.
    for call in chain.tail.engine.calls:
        assert call.hidden is not None
        assert not (call.hidden.view(np.uint32) & 0xFFFF).any()
    first = reference_logits(prompt, 0)[0]
    # Largest logit error relative to the logits' scale (per-element ratios explode near zero).
    error = float(np.max(np.abs(logits[0] - first)) / np.max(np.abs(first)))
    assert 0 < error < 0.02
    assert agreement >= 0.9


def test_a_duplicated_step_through_the_chain_is_applied_once_everywhere() -> None:
    prompt = [4, 4, 2]
    chain = Chain()
    link = head_link(chain)
    expected = reference(prompt, 3)
    assert run_generation(link, prompt, 1)[0] == expected[:2]
    head_calls, tail_calls = len(chain.head.engine.calls), len(chain.tail.engine.calls)

    # The same decode step again (a retry after a lost answer): same step, same work id.
    step = link.client.next_step - 1
    again = decode_request(step, expected[0], len(prompt), work_id=f"s1/1/{step}")
    out = chain.head.ask(link.stream, again)
    assert acks(out)[0].duplicate
    assert result_tokens(out) == [expected[1]]
    assert (len(chain.head.engine.calls), len(chain.tail.engine.calls)) == (head_calls, tail_calls)

    # And the following output is still identical.
    link.client.submit_decode(expected[1], position=len(prompt) + 1)
    link.pump()
    (event,) = link.client.take_events()
    assert int(event.tensors()["token_ids"].array[0]) == expected[2]


def test_a_next_hop_refusal_travels_back_and_a_retry_re_forwards_without_re_running() -> None:
    prompt = [6, 1, 6]
    chain = Chain()
    link = head_link(chain)
    expected = reference(prompt, 1)
    run_generation(link, prompt, 0)

    chain.tail.engine.fail_next = EngineError(EngineErrorKind.RESOURCE_EXHAUSTED, "kv full")
    link.client.submit_decode(expected[0], position=len(prompt))
    link.pump()
    (failed,) = link.client.take_events()
    assert isinstance(failed, UnitFailed) and isinstance(failed.error, ShardProtocolError)
    assert failed.error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED
    assert failed.error.retryable
    head_calls = len(chain.head.engine.calls)

    link.client.retry(failed.unit_id)
    link.pump()
    (done,) = link.client.take_events()
    assert isinstance(done, UnitDone) and done.duplicate  # the head did not apply it again
    assert int(done.tensors()["token_ids"].array[0]) == expected[1]
    assert len(chain.head.engine.calls) == head_calls


def forwarding_worker() -> tuple[WorkerHarness, int]:
    """A head worker whose next hop never answers by itself: Forward actions just accumulate."""
    harness = WorkerHarness(RecordingEngine(0, 2))
    route = make_route([make_hop(NODE_B, 2, 4, 2)])
    stream, items = harness.open(route, shard_range=srange(0, 2))
    assert kinds(items) == ["accepted"]
    return harness, stream


def forwards(actions: list) -> list[Forward]:
    return [a for a in actions if isinstance(a, Forward)]


def test_forward_carries_the_unit_for_the_next_hop() -> None:
    harness, stream = forwarding_worker()
    deadline = harness.unix_now + SECOND
    (forward,) = forwards(
        harness.send(stream, chunk_request(1, [1, 2, 3], shard_range=srange(0, 2), deadline=deadline))
    )
    assert forward.session == SessionKey("s1", 1)
    assert forward.hop.shard_range.effective_start_layer == 2
    assert list(forward.route.downstream) == []
    work = forward.work
    # The deadline travels on as it arrived, on both clocks.
    assert (work.step, work.work_id, work.deadline) == (1, "w1", Deadline(deadline, harness.now + SECOND))
    assert work.position == UnitPosition(
        decode=False, first_position=0, token_count=3, expected_past_len=None, chunk_index=0, chunk_count=1
    )
    assert work.hidden.shape == (3, 8) and work.hidden.dtype == np.float32


def test_a_next_hop_transport_failure_is_internal_and_retryable() -> None:
    harness, stream = forwarding_worker()
    (forward,) = forwards(harness.send(stream, chunk_request(1, [1, 2], shard_range=srange(0, 2))))
    actions = harness.downstream_finished(forward.unit_id, SessionTransportError("reset"), harness.now)
    status = only_status(responses(actions, stream))
    assert status.error.code == shard.ERROR_CODE_INTERNAL and status.error.retryable
    assert "reset" not in status.error.detail


def test_a_duplicate_arriving_while_forwarding_is_answered_with_the_original() -> None:
    harness, stream = forwarding_worker()
    (forward,) = forwards(harness.send(stream, chunk_request(1, [1, 2], shard_range=srange(0, 2))))
    harness.stream_closed(stream, harness.now)
    retry_stream, _ = harness.open(make_route([make_hop(NODE_B, 2, 4, 2)]), shard_range=srange(0, 2))
    assert forwards(harness.send(retry_stream, chunk_request(1, [1, 2], shard_range=srange(0, 2)))) == []
    token = encode_bundle([])
    actions = harness.downstream_finished(forward.unit_id, DownstreamResult(token), harness.now)
    out = responses(actions, retry_stream)
    assert kinds(out)[:2] == ["chunk", "ack"] and acks(out)[0].duplicate
    assert len(harness.engine.calls) == 1


def test_cancel_while_forwarding_passes_on_and_the_late_result_is_kept() -> None:
    harness, stream = forwarding_worker()
    (forward,) = forwards(harness.send(stream, chunk_request(1, [1, 2], shard_range=srange(0, 2))))
    count, actions = harness.cancel("s1", 1, "", harness.now)
    assert count == 1
    assert only_status(responses(actions, stream)).error.code == shard.ERROR_CODE_CANCELLED
    assert [a for a in actions if isinstance(a, CancelDownstream)] == [
        CancelDownstream(SessionKey("s1", 1), "")
    ]
    harness.downstream_finished(forward.unit_id, DownstreamResult(None), harness.now)
    replay = harness.ask(stream, chunk_request(1, [1, 2], shard_range=srange(0, 2)))
    assert acks(replay)[0].duplicate and len(harness.engine.calls) == 1


def test_release_passes_on_to_the_next_hop() -> None:
    harness, _ = forwarding_worker()
    actions = harness.release("s1", 1, harness.now)[1]
    assert ReleaseEngine(SessionKey("s1", 1)) in actions
    assert ReleaseDownstream(SessionKey("s1", 1)) in actions


def test_a_next_hop_without_downstream_returns_hidden_states() -> None:
    harness = WorkerHarness(RecordingEngine(0, 2))
    stream, _ = harness.open(shard_range=srange(0, 2))
    out = harness.ask(stream, chunk_request(1, [1, 2, 3], shard_range=srange(0, 2)))
    assert kinds(out)[:2] == ["chunk", "ack"]
    (tensor,) = out[0].chunk.bundle.tensors
    assert tensor.name == "hidden_states" and list(tensor.shape) == [3, 8]
    assert tensor.dtype == shard.DTYPE_FLOAT32
