"""Schema versions, and what one unit's envelope promises about its place in the session.

Pure checks over ``meshnet.shard.v1`` messages; every refusal is PAYLOAD_CORRUPT
(an envelope that contradicts itself) unless noted.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.dataplane.errors import payload_corrupt
from meshnode.wire.pb import shard

SUPPORTED_SCHEMA_VERSIONS = (shard.SCHEMA_VERSION_1,)
HIGHEST_SCHEMA_VERSION = max(SUPPORTED_SCHEMA_VERSIONS)


def digests(fingerprint: shard.Fingerprint) -> tuple[str, str]:
    """What identity compares: the two digests, never the labels."""
    return fingerprint.model_artifact_digest, fingerprint.runtime_recipe_digest


def range_tuple(shard_range: shard.ShardRange) -> tuple[int, int, int]:
    return shard_range.start_layer, shard_range.end_layer, shard_range.effective_start_layer


@dataclass(frozen=True, slots=True)
class UnitSpan:
    """Where an ActivationChunk sits: its cache expectation, kind and chunk position."""

    # None: a fresh start at position 0; otherwise the exact cache length required.
    expected_past_len: int | None
    decode: bool
    chunk_index: int
    chunk_count: int


def unit_span(envelope: shard.Envelope) -> UnitSpan:
    """Read an ActivationChunk's phase, position, cache expectation and chunk info together.

    A prefill chunk at position 0 with cache mode PREFILL (or STATELESS, run the
    same way) starts fresh; a later chunk uses mode DECODE expecting exactly its
    first position; a decode unit is one token with mode DECODE at its position.
    """
    first = envelope.position.first_position
    if envelope.position.token_count < 1:
        raise payload_corrupt("a unit carries at least one token position")
    expectation = envelope.cache_expectation
    if envelope.phase == shard.PHASE_PREFILL:
        info = envelope.chunk
        if info.chunk_count < 1 or info.chunk_index >= info.chunk_count:
            raise payload_corrupt("prefill chunk info is missing or out of range")
        if info.final_chunk != (info.chunk_index == info.chunk_count - 1):
            raise payload_corrupt("final_chunk disagrees with the chunk index")
        if expectation.mode in (shard.CACHE_MODE_PREFILL, shard.CACHE_MODE_STATELESS):
            if first != 0:
                raise payload_corrupt("a fresh prefill starts at position 0")
            return UnitSpan(None, False, info.chunk_index, info.chunk_count)
        if expectation.mode == shard.CACHE_MODE_DECODE:
            if expectation.expected_past_len != first:
                raise payload_corrupt("a continued prefill expects the cache to hold its first position")
            return UnitSpan(first, False, info.chunk_index, info.chunk_count)
        raise payload_corrupt("envelope has no cache expectation")
    if envelope.phase == shard.PHASE_DECODE:
        if (
            expectation.mode != shard.CACHE_MODE_DECODE
            or envelope.position.token_count != 1
            or expectation.expected_past_len != first
        ):
            raise payload_corrupt("a decode unit is one token continuing the cache at its position")
        return UnitSpan(first, True, 0, 1)
    raise payload_corrupt("a unit's phase must be PREFILL or DECODE")


__all__ = [
    "HIGHEST_SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "UnitSpan",
    "digests",
    "range_tuple",
    "unit_span",
]
