"""Flow-control negotiation: each limit settles at the stricter of the two peers.

A sender must not be able to talk a worker into unbounded queues, so every
field takes the smaller value, and the initial credit grant is capped by the
settled in-flight ceiling. A zero field means "no preference" (proto3 cannot
tell an unset field from zero, and a zero limit would wedge the session).
"""

from __future__ import annotations

from meshnode.wire.chunking import DEFAULT_MAX_PREFILL_CHUNK_TOKENS
from meshnode.wire.framing import LENGTH_PREFIX_BYTES, MAX_FRAME_BYTES
from meshnode.wire.pb import shard

# A chunk message travels in one frame, so it can never exceed the frame cap.
MAX_CHUNK_BYTES_CEILING = MAX_FRAME_BYTES - LENGTH_PREFIX_BYTES


def default_flow_control() -> shard.FlowControl:
    return shard.FlowControl(
        credits_granted=4,
        max_inflight_chunks=8,
        max_chunk_bytes=MAX_CHUNK_BYTES_CEILING,
        max_prefill_chunk_tokens=DEFAULT_MAX_PREFILL_CHUNK_TOKENS,
    )


def _stricter(a: int, b: int) -> int:
    if a == 0:
        return b
    if b == 0:
        return a
    return min(a, b)


def negotiate_flow_control(proposed: shard.FlowControl, local: shard.FlowControl) -> shard.FlowControl:
    """The limits that apply to a session: the stricter of each field."""
    max_inflight = _stricter(proposed.max_inflight_chunks, local.max_inflight_chunks) or 1
    credits = _stricter(proposed.credits_granted, local.credits_granted) or 1
    max_chunk_bytes = _stricter(proposed.max_chunk_bytes, local.max_chunk_bytes) or MAX_CHUNK_BYTES_CEILING
    max_tokens = (
        _stricter(proposed.max_prefill_chunk_tokens, local.max_prefill_chunk_tokens)
        or DEFAULT_MAX_PREFILL_CHUNK_TOKENS
    )
    return shard.FlowControl(
        credits_granted=min(credits, max_inflight),
        max_inflight_chunks=max_inflight,
        max_chunk_bytes=min(max_chunk_bytes, MAX_CHUNK_BYTES_CEILING),
        max_prefill_chunk_tokens=max_tokens,
    )


__all__ = ["MAX_CHUNK_BYTES_CEILING", "default_flow_control", "negotiate_flow_control"]
