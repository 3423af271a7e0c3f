"""How one admitted unit becomes an engine step, and how its outcome becomes an answer (pure).

The refusals a unit meets on its way (a replay verdict that is no replay, a cache the engine
is known not to hold), the :class:`~engines.interface.StepRequest` it runs as, the tensors a
result carries back (the tail's token, or a middle hop's hidden states in the stream's
compression), and what a next hop's failure becomes for the unit that waited on it.
"""

from __future__ import annotations

from engines.interface import CancelToken, StepRequest, StepResult, rollback_refusal
from meshnode.dataplane import errors, responses
from meshnode.dataplane.envelope import Deadline, UnitPosition
from meshnode.dataplane.payload import encode_hidden, encode_token_result, encode_verify_result
from meshnode.dataplane.steps import Verdict
from meshnode.dataplane.worker_state import SessionState, Unit
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle


def passed(deadline: Deadline | None, now_ns: int) -> bool:
    return deadline is not None and now_ns >= deadline.at_ns


def verdict_refusal(verdict: Verdict, session: SessionState) -> ShardProtocolError:
    """The refusal for a unit the session's ledger does not admit (any verdict but ADMIT and REPLAY)."""
    actual = session.past_len or 0
    if verdict is Verdict.UNSET:
        return errors.payload_corrupt("idempotency_step 0 is unset; steps start at 1")
    if verdict is Verdict.GAP:
        return errors.cache_miss(
            f"step skips ahead of step {session.ledger.highest_admitted}; re-prefill from position 0", actual
        )
    if verdict is Verdict.REUSED_STEP:
        return errors.cache_miss("step was already applied for other work", actual)
    return errors.cache_miss("the session moved past this step", actual)


def cache_refusal(session: SessionState, position: UnitPosition) -> ShardProtocolError | None:
    """The CACHE_MISS a unit meets before the engine, by what the worker knows the engine holds
    (nothing when it does not know: the engine then decides, by the same rule)."""
    expected, held = position.expected_past_len, session.past_len
    if expected is None or held is None or held == expected:
        return None
    if position.prefix_digest and held == 0:
        # A session's first unit naming a kept prefix: only the engine knows what it kept.
        return None
    if not position.rollback:
        return errors.cache_miss(f"session holds {held} tokens, not {expected}", held)
    if session.committed_len is None:
        return None
    refusal = rollback_refusal(held, session.committed_len, expected)
    return None if refusal is None else errors.cache_miss(refusal, held)


def step_request(unit: Unit, token: CancelToken) -> StepRequest:
    """The engine step ``unit`` runs as (raises EngineError when the engine's rules refuse it)."""
    session, position = unit.session, unit.position
    assert unit.input is not None
    sample = position.final and session.role.is_tail
    return StepRequest(
        session=session.key,
        first_position=position.first_position,
        token_ids=unit.input.token_ids,
        hidden=unit.input.hidden,
        expected_past_len=position.expected_past_len if position.decode else None,
        effective_start_layer=session.shard_range[2],
        sampling=session.plan.sampling if sample else None,
        want_logits=sample and session.plan.return_logits,
        sample_index=position.end,
        work_id=unit.work_id,
        cancel_token=token,
        draft_tokens=position.draft_tokens,
        rollback=position.rollback,
        block_digest=position.block_digest,
        prefix_digest=position.prefix_digest,
    )


def result_bundle(unit: Unit, result: StepResult, compression: int) -> shard.TensorBundle | None:
    """What a tail's result chunk carries (its token, the verify choices, logits when asked), or
    ``None`` when it sampled nothing; a middle hop's hidden states in ``compression``."""
    role = unit.session.role
    if role.is_tail:
        if result.token_id is None:
            return None
        logits = result.logits if unit.session.plan.return_logits else None
        if unit.position.verify and result.token_ids is not None:
            return encode_verify_result(tuple(int(t) for t in result.token_ids), logits)
        return encode_token_result(int(result.token_id), logits)
    assert result.hidden is not None
    return encode_bundle([encode_hidden(result.hidden, role.boundary_dtype, compression)])


def result_chunk(unit: Unit, bundle: shard.TensorBundle) -> shard.SessionResponse:
    return responses.result_chunk(
        work_id=unit.work_id,
        session_id=unit.session.session_id,
        epoch=unit.session.epoch,
        step=unit.step,
        decode=unit.position.decode,
        first_position=unit.position.first_position,
        token_count=unit.position.token_count,
        bundle=bundle,
    )


def downstream_error(outcome: object) -> ShardProtocolError:
    """What the next hop's failure becomes for the units waiting on it."""
    if isinstance(outcome, ShardProtocolError):
        # The next hop's code and retry advice travel on; its detail text does not.
        return errors.refusal(
            outcome.code,
            f"next hop refused: {outcome.code_name}",
            retryable=outcome.retryable,
            actual_past_len=outcome.actual_past_len,
        )
    return errors.refusal(shard.ERROR_CODE_INTERNAL, "next hop unreachable", retryable=True)


__all__ = [
    "cache_refusal",
    "downstream_error",
    "passed",
    "result_bundle",
    "result_chunk",
    "step_request",
    "verdict_refusal",
]
