"""Builders for the SessionResponse messages a worker sends. No state, no decisions."""

from __future__ import annotations

from typing import cast

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
    commitments: tuple[shard.SignedCommitment, ...] = (),
) -> shard.SessionResponse:
    # Filled in place: nesting keyword-built messages copies each of them once more (2x the cost
    # on every unit of every hop, bench/RESULTS.md "Single-stream hop latency").
    response = shard.SessionResponse()
    message = response.ack
    message.work_id = work_id
    message.idempotency_step = step
    message.cache_result.CopyFrom(cache_result)
    message.duplicate = duplicate
    message.execution_nanos = execution_nanos
    message.answered_directly = answered_directly
    if commitments:
        message.commitments.extend(commitments)
    return response


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
    response = shard.SessionResponse()
    chunk = response.chunk
    envelope = chunk.envelope
    envelope.schema_version = HIGHEST_SCHEMA_VERSION
    envelope.work_id = work_id
    envelope.route_session_id = session_id
    envelope.route_epoch = epoch
    envelope.phase = shard.PHASE_DECODE if decode else shard.PHASE_PREFILL
    envelope.position.first_position = first_position
    envelope.position.token_count = token_count
    envelope.idempotency_step = step
    chunk.bundle.CopyFrom(bundle)
    return response


def accepted(
    *,
    schema_version: int,
    session_id: str,
    epoch: int,
    flow: shard.FlowControl,
    compressions: tuple[int, ...],
    fingerprint: shard.Fingerprint,
) -> shard.SessionResponse:
    # The worker keeps the schema version and its compressions as plain ints (proto3 enums are
    # open: any int is a value); the protobuf stubs type enum fields as the enum class.
    return shard.SessionResponse(
        accepted=shard.SessionAccepted(
            schema_version=cast(shard.SchemaVersion, schema_version),
            route_session_id=session_id,
            route_epoch=epoch,
            flow_control=flow,
            accepted_compression=cast(list[shard.Compression], list(compressions)),
            fingerprint=fingerprint,
        )
    )


__all__ = ["accepted", "ack", "credit_grant", "result_chunk", "status"]
