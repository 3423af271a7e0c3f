"""Speculative decoding on the shard side (issue 20): verify steps and the envelope's rollback.

A verify step is a PHASE_DECODE unit of 1 + ``Envelope.draft_tokens`` positions; the tail answers
the greedy choice after every position. The next unit may set ``CacheExpectation.rollback``: the
hop drops the rejected drafts (down to the unit's expected length, never below the committed one
and never above what it holds; else CACHE_MISS with the length held) before running it. The fake
model's output depends on every cached position, so a draft left behind would change the tokens.
"""

from __future__ import annotations

import pytest

from engines.interface import MAX_DRAFT_TOKENS, EngineError, EngineErrorKind, SamplingParams, StepRequest
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import decode_bundle

from .harness import (
    WorkerHarness,
    acks,
    chunk_request,
    decode_request,
    only_status,
    reference,
)

pytestmark = pytest.mark.timeout(30)

PROMPT = [5, 3, 8, 1, 9, 2, 7]
P = len(PROMPT)


def verify_request(
    step: int, tokens: list[int], position: int, *, drafts: int | None = None, rollback: bool = False
) -> shard.SessionRequest:
    """A decode unit of ``tokens`` at ``position``: the last accepted token and its drafts."""
    request = chunk_request(step, tokens, first_position=position, phase=shard.PHASE_DECODE)
    request.chunk.envelope.draft_tokens = len(tokens) - 1 if drafts is None else drafts
    request.chunk.envelope.cache_expectation.rollback = rollback
    return request


def chunk_tokens(items: list[shard.SessionResponse]) -> list[int]:
    (chunk,) = [r.chunk for r in items if r.WhichOneof("kind") == "chunk"]
    return decode_bundle(chunk.bundle)["token_ids"].array.tolist()


def prefilled(h: WorkerHarness) -> int:
    work, _ = h.open()
    h.ask(work, chunk_request(1, PROMPT))
    return work


def test_a_verify_step_answers_the_greedy_choice_after_every_position():
    expected = reference(PROMPT, 6)
    h = WorkerHarness()
    work = prefilled(h)
    # The accepted token, then drafts that are what the model would choose: every one agrees.
    items = h.ask(work, verify_request(2, expected[:5], P))
    assert chunk_tokens(items) == expected[1:6]
    (ack,) = acks(items)
    assert ack.cache_result.past_len == P + 5


def test_rejected_drafts_rolled_back_leave_the_cache_as_if_they_were_never_sent():
    expected = reference(PROMPT, 8)
    h = WorkerHarness()
    work = prefilled(h)
    wrong = [(t + 1) % 32 for t in expected[2:5]]
    # Drafts: the right second token, then three wrong ones: one accepted, the choice after it kept.
    items = h.ask(work, verify_request(2, [expected[0], expected[1], *wrong], P))
    choices = chunk_tokens(items)
    assert choices[:2] == expected[1:3]
    # The next round starts after the accepted draft and its correction, at P + 2, rolling back.
    items = h.ask(work, verify_request(3, [expected[2]], P + 2, rollback=True))
    assert chunk_tokens(items) == [expected[3]]
    assert acks(items)[0].cache_result.past_len == P + 3
    # And plain decoding goes on exactly as the whole model's greedy run.
    token, position, step = expected[3], P + 3, 4
    for want in expected[4:8]:
        (token,) = chunk_tokens(h.ask(work, decode_request(step, token, position)))
        assert token == want
        position, step = position + 1, step + 1


def test_a_rollback_below_the_committed_length_is_a_cache_miss():
    h = WorkerHarness()
    work = prefilled(h)
    expected = reference(PROMPT, 1)
    h.ask(work, verify_request(2, [expected[0], 1, 2, 3], P))
    # The verify step's first token (at P) was accepted: the committed length is P + 1.
    status = only_status(h.ask(work, verify_request(3, [4], P, rollback=True)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == P + 4 and not status.error.retryable


def test_a_rollback_above_what_the_cache_holds_is_a_cache_miss():
    h = WorkerHarness()
    work = prefilled(h)
    expected = reference(PROMPT, 1)
    h.ask(work, verify_request(2, [expected[0], 1, 2], P))
    status = only_status(h.ask(work, verify_request(3, [4], P + 4, rollback=True)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == P + 3


def test_the_engine_refuses_the_same_rollbacks_when_the_worker_cannot_tell():
    """The worker's check is a shortcut; the engine holds the same rule, with the length held."""
    h = WorkerHarness()
    work = prefilled(h)
    expected = reference(PROMPT, 1)
    h.ask(work, verify_request(2, [expected[0], 1, 2], P))
    key = h.engine.calls[-1].session
    for position in (P, P + 4):
        with pytest.raises(EngineError) as refused:
            h.engine.decode(
                StepRequest(
                    session=key,
                    first_position=position,
                    token_ids=(4,),
                    expected_past_len=position,
                    rollback=True,
                )
            )
        assert refused.value.kind is EngineErrorKind.CACHE_MISS and refused.value.actual_past_len == P + 3


def test_held_drafts_without_a_rollback_are_a_cache_miss_as_before():
    h = WorkerHarness()
    work = prefilled(h)
    expected = reference(PROMPT, 1)
    h.ask(work, verify_request(2, [expected[0], 1, 2], P))
    status = only_status(h.ask(work, decode_request(3, 4, P + 1)))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS and status.error.actual_past_len == P + 3


@pytest.mark.parametrize(
    ("phase", "drafts", "rollback"),
    [
        (shard.PHASE_PREFILL, 1, False),
        (shard.PHASE_PREFILL, 0, True),
        (shard.PHASE_DECODE, 2, False),  # 2 drafts declared, 1 carried
        (shard.PHASE_DECODE, MAX_DRAFT_TOKENS + 1, False),
    ],
)
def test_drafts_or_a_rollback_where_they_do_not_belong_are_payload_corrupt(phase, drafts, rollback):
    h = WorkerHarness()
    work = prefilled(h)
    tokens = [1, 2] if drafts <= MAX_DRAFT_TOKENS else list(range(drafts + 1))
    request = chunk_request(2, tokens, first_position=P, phase=phase)
    request.chunk.envelope.cache_expectation.mode = shard.CACHE_MODE_DECODE
    request.chunk.envelope.cache_expectation.expected_past_len = P
    request.chunk.envelope.draft_tokens = drafts
    request.chunk.envelope.cache_expectation.rollback = rollback
    assert only_status(h.ask(work, request)).error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_a_retried_verify_step_is_answered_from_its_record_not_applied_again():
    expected = reference(PROMPT, 4)
    h = WorkerHarness()
    work = prefilled(h)
    request = verify_request(2, [expected[0], expected[1], 0, 0], P)
    first = h.ask(work, request)
    calls = len(h.engine.calls)
    again = h.ask(work, request)
    assert len(h.engine.calls) == calls
    assert chunk_tokens(again) == chunk_tokens(first)
    (ack,) = acks(again)
    assert ack.duplicate and ack.cache_result.past_len == P + 4
    # The rollback after it still finds the drafts where the one application left them.
    items = h.ask(work, verify_request(3, [expected[2]], P + 2, rollback=True))
    assert chunk_tokens(items) == [expected[3]]


def test_a_tail_does_not_verify_drafts_for_a_penalised_request():
    h = WorkerHarness()
    work = prefilled(h)
    key = h.engine.calls[-1].session
    assert work
    with pytest.raises(EngineError) as refused:
        h.engine.prefill(
            StepRequest(
                session=key,
                first_position=P,
                token_ids=(1, 2),
                sampling=SamplingParams(temperature=0.8, seed=3, repeat_penalty=1.1),
                draft_tokens=1,
            )
        )
    assert refused.value.kind is EngineErrorKind.INVALID_REQUEST and "no penalty" in refused.value.detail
    # The same step asking for a seeded draw without the penalty is verified.
    seeded = h.engine.prefill(
        StepRequest(
            session=key,
            first_position=P,
            token_ids=(1, 2),
            sampling=SamplingParams(temperature=0.8, seed=3),
            draft_tokens=1,
        )
    )
    assert seeded.token_ids is not None and len(seeded.token_ids) == 2
