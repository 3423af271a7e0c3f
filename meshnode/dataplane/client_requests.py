"""What a session's sender writes on its streams, built from the session's address (pure).

The first two frames of a work stream (the route, then ``SessionOpen``) and of an answer
stream, each unit's request (a ``DecodeStep`` on the hot path, an ``ActivationChunk`` with its
envelope otherwise), and the in-band and unary signals. Nothing here keeps state: the
:class:`~meshnode.dataplane.client.SessionClient` decides what to send and when.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.dataplane.envelope import HIGHEST_SCHEMA_VERSION, Deadline, UnitPosition, wire_deadline
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle


@dataclass(frozen=True)
class SessionAddress:
    """What names a route session at one hop: every request to that hop carries it."""

    route_session_id: str
    route_epoch: int
    fingerprint: shard.Fingerprint
    shard_range: shard.ShardRange
    route: dataplane.SessionRoute


def _open(
    address: SessionAddress,
    shard_range: shard.ShardRange,
    proposed: shard.FlowControl,
    compressions: Sequence[shard.Compression],
    *,
    answer_stream: bool,
) -> bytes:
    open_ = shard.SessionOpen(
        schema_version=HIGHEST_SCHEMA_VERSION,
        route_session_id=address.route_session_id,
        route_epoch=address.route_epoch,
        fingerprint=address.fingerprint,
        shard_range=shard_range,
        proposed_flow_control=proposed,
        accepted_compression=list(compressions),
        answer_stream=answer_stream,
    )
    return shard.SessionRequest(open=open_).SerializeToString()


def work_stream_opening(
    address: SessionAddress, proposed: shard.FlowControl, compressions: Sequence[shard.Compression]
) -> list[bytes]:
    """Bodies of a work stream's first two frames: the SessionRoute, then SessionOpen."""
    opening = _open(address, address.shard_range, proposed, compressions, answer_stream=False)
    return [address.route.SerializeToString(), opening]


def answer_stream_opening(
    address: SessionAddress,
    tail_range: shard.ShardRange,
    proposed: shard.FlowControl,
    compressions: Sequence[shard.Compression],
) -> list[bytes]:
    """Bodies of the answer stream's first two frames to the route's tail (``tail_range``): an
    empty route, then a SessionOpen that asks for the session's direct answers."""
    route = dataplane.SessionRoute(gen=address.route.gen)
    opening = _open(address, tail_range, proposed, compressions, answer_stream=True)
    return [route.SerializeToString(), opening]


def unit_request(
    address: SessionAddress,
    *,
    step: int,
    work_id: str,
    position: UnitPosition,
    deadline: Deadline | None,
    tensor: shard.NamedTensor,
    handoff: shard.SignedHandoff | None = None,
) -> shard.SessionRequest:
    """One unit's request: a DecodeStep for a plain decode, an ActivationChunk otherwise.
    ``handoff``: the sender's signed statement of the tensor (meshnode.audit.handoff), if any."""
    if position.single_decode and not position.rollback:
        # Filled in place: a keyword-built DecodeStep nested in a keyword-built request copies
        # the tensor's payload twice (the hot path: every token, every hop).
        request = shard.SessionRequest()
        decode = request.decode
        decode.idempotency_step = step
        decode.position = position.first_position
        decode.expected_past_len = position.first_position
        decode.tensor.CopyFrom(tensor)
        decode.work_id = work_id
        decode.deadline_unix_nanos = wire_deadline(deadline)
        if handoff is not None:
            decode.handoff.CopyFrom(handoff)
        return request
    fresh = position.fresh_start
    envelope = shard.Envelope(
        schema_version=HIGHEST_SCHEMA_VERSION,
        work_id=work_id,
        route_session_id=address.route_session_id,
        route_epoch=address.route_epoch,
        fingerprint=address.fingerprint,
        shard_range=address.shard_range,
        phase=shard.PHASE_DECODE if position.decode else shard.PHASE_PREFILL,
        position=shard.PositionSpan(first_position=position.first_position, token_count=position.token_count),
        idempotency_step=step,
        cache_expectation=shard.CacheExpectation(
            mode=shard.CACHE_MODE_PREFILL if fresh else shard.CACHE_MODE_DECODE,
            expected_past_len=0 if fresh else position.first_position,
            rollback=position.rollback,
            prefix_digest=position.prefix_digest,
        ),
        deadline_unix_nanos=wire_deadline(deadline),
        chunk=shard.ChunkInfo(
            chunk_index=position.chunk_index,
            chunk_count=position.chunk_count,
            final_chunk=position.final,
        ),
        draft_tokens=position.draft_tokens,
        block_digest=position.block_digest,
        handoff=handoff,
    )
    return shard.SessionRequest(
        chunk=shard.ActivationChunk(envelope=envelope, bundle=encode_bundle([tensor]))
    )


def cancel_signal(address: SessionAddress, work_id: str, reason: str) -> bytes:
    """An in-band CancelSignal body (no credit needed)."""
    signal = shard.CancelSignal(
        route_session_id=address.route_session_id,
        route_epoch=address.route_epoch,
        work_id=work_id,
        reason=reason,
    )
    return shard.SessionRequest(cancel=signal).SerializeToString()


def cancel_request(address: SessionAddress, work_id: str, reason: str) -> shard.CancelRequest:
    """The unary Cancel for a fresh SHARD_CANCEL stream."""
    return shard.CancelRequest(
        schema_version=HIGHEST_SCHEMA_VERSION,
        route_session_id=address.route_session_id,
        route_epoch=address.route_epoch,
        work_id=work_id,
        reason=reason,
    )


def release_signal(address: SessionAddress, work_id: str) -> bytes:
    signal = shard.ReleaseSignal(
        route_session_id=address.route_session_id, route_epoch=address.route_epoch, work_id=work_id
    )
    return shard.SessionRequest(release=signal).SerializeToString()


def release_request(address: SessionAddress) -> shard.ReleaseRequest:
    return shard.ReleaseRequest(
        schema_version=HIGHEST_SCHEMA_VERSION,
        route_session_id=address.route_session_id,
        route_epoch=address.route_epoch,
    )


__all__ = [
    "SessionAddress",
    "answer_stream_opening",
    "cancel_request",
    "cancel_signal",
    "release_request",
    "release_signal",
    "unit_request",
    "work_stream_opening",
]
