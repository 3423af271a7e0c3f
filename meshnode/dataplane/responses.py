"""Builders for the SessionResponse messages a worker sends. No state, no decisions."""

from __future__ import annotations

from meshnode.dataplane.envelope import HIGHEST_SCHEMA_VERSION
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


def ack(
    work_id: str,
    step: int,
    cache_result: shard.CacheResult,
    *,
    duplicate: bool,
    execution_nanos: int,
    answered_directly: bool = False,
) -> shard.SessionResponse:
    return shard.SessionResponse(
        ack=shard.Ack(
            work_id=work_id,
            idempotency_step=step,
            cache_result=cache_result,
            duplicate=duplicate,
            execution_nanos=execution_nanos,
            answered_directly=answered_directly,
        )
    )


def status(
    work_id: str, session_id: str, step: int, error: ShardProtocolError, *, terminal: bool
) -> shard.SessionResponse:
    return shard.SessionResponse(
        status=shard.ShardStatus(
            work_id=work_id,
            route_session_id=session_id,
            idempotency_step=step,
            error=error.to_pb(),
            terminal=terminal,
        )
    )


def credit_grant(flow: shard.FlowControl, credits: int) -> shard.SessionResponse:
    """Grant ``credits`` more un-acked units; the negotiated limits are repeated for the record."""
    return shard.SessionResponse(
        flow_control=shard.FlowControl(
            credits_granted=credits,
            max_inflight_chunks=flow.max_inflight_chunks,
            max_chunk_bytes=flow.max_chunk_bytes,
            max_prefill_chunk_tokens=flow.max_prefill_chunk_tokens,
        )
    )


def result_chunk(
    *,
    work_id: str,
    session_id: str,
    epoch: int,
    step: int,
    decode: bool,
    first_position: int,
    token_count: int,
    bundle: shard.TensorBundle,
) -> shard.SessionResponse:
    """A unit's result tensors, with just enough envelope to name the unit they answer."""
    envelope = shard.Envelope(
        schema_version=HIGHEST_SCHEMA_VERSION,  # type: ignore[arg-type]
        work_id=work_id,
        route_session_id=session_id,
        route_epoch=epoch,
        phase=shard.PHASE_DECODE if decode else shard.PHASE_PREFILL,
        position=shard.PositionSpan(first_position=first_position, token_count=token_count),
        idempotency_step=step,
    )
    return shard.SessionResponse(chunk=shard.ActivationChunk(envelope=envelope, bundle=bundle))


def accepted(
    *,
    schema_version: int,
    session_id: str,
    epoch: int,
    flow: shard.FlowControl,
    compressions: tuple[int, ...],
    fingerprint: shard.Fingerprint,
) -> shard.SessionResponse:
    return shard.SessionResponse(
        accepted=shard.SessionAccepted(
            schema_version=schema_version,  # type: ignore[arg-type]
            route_session_id=session_id,
            route_epoch=epoch,
            flow_control=flow,
            accepted_compression=list(compressions),  # type: ignore[arg-type]
            fingerprint=fingerprint,
        )
    )


__all__ = ["accepted", "ack", "credit_grant", "result_chunk", "status"]
