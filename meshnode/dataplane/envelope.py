"""Schema versions, and what one unit's envelope promises about its place in the session.

Pure checks over ``meshnet.shard.v1`` messages; every refusal is PAYLOAD_CORRUPT
(an envelope that contradicts itself) unless noted.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.interface import EngineFingerprint
from engines.request_limits import MAX_DRAFT_TOKENS, MAX_PREFIX_DIGEST_BYTES
from meshnode.dataplane.errors import payload_corrupt
from meshnode.wire.pb import shard

SUPPORTED_SCHEMA_VERSIONS = (shard.SCHEMA_VERSION_1,)
HIGHEST_SCHEMA_VERSION = max(SUPPORTED_SCHEMA_VERSIONS)


def fingerprint_message(fingerprint: EngineFingerprint) -> shard.Fingerprint:
    """An engine's fingerprint as the wire carries it (announcements, SessionOpen, capability)."""
    return shard.Fingerprint(
        model_artifact_digest=fingerprint.model_artifact_digest,
        runtime_recipe_digest=fingerprint.runtime_recipe_digest,
        recipe_id=fingerprint.recipe_id,
        recipe_version=fingerprint.recipe_version,
        catalogue_version=fingerprint.catalogue_version,
    )


def digests(fingerprint: shard.Fingerprint) -> tuple[str, str]:
    """What identity compares: the two digests, never the labels."""
    return fingerprint.model_artifact_digest, fingerprint.runtime_recipe_digest


def range_tuple(shard_range: shard.ShardRange) -> tuple[int, int, int]:
    return shard_range.start_layer, shard_range.end_layer, shard_range.effective_start_layer


@dataclass(frozen=True, slots=True)
class UnitPosition:
    """Where one unit of work sits in its session: the tokens it carries, what the cache must
    hold before it, and its place among a prefill's chunks.

    The worker's units, the client's units and the work a worker forwards all carry one,
    so the rules below are read from an envelope once and travel unchanged.
    """

    decode: bool
    first_position: int
    token_count: int
    # None: a fresh start at position 0; otherwise the exact cache length required.
    expected_past_len: int | None
    chunk_index: int = 0
    chunk_count: int = 1
    # Speculative decoding (meshnode extension, Envelope.draft_tokens): a decode unit's last
    # positions that are drafts; the unit then carries 1 + draft_tokens positions.
    draft_tokens: int = 0
    # CacheExpectation.rollback: the cache may hold uncommitted drafts past expected_past_len,
    # which the receiver drops first.
    rollback: bool = False
    # Prefix cache (Envelope.block_digest): a prefill unit that completes a block of the head's
    # grid carries the digest of every token up to its end; empty otherwise.
    block_digest: bytes = b""
    # CacheExpectation.prefix_digest: a continued prefill that may open its session from the
    # receiver's kept prefix of ``first_position`` tokens with this digest.
    prefix_digest: bytes = b""

    @property
    def fresh_start(self) -> bool:
        return self.expected_past_len is None

    @property
    def final(self) -> bool:
        """The last chunk of its prefill (a decode step is its own last chunk)."""
        return self.chunk_index == self.chunk_count - 1

    @property
    def verify(self) -> bool:
        """A verify step of speculative decoding: the tail returns a token for every position."""
        return self.draft_tokens > 0

    @property
    def single_decode(self) -> bool:
        """One plain decode token (what batches with other sessions' decodes, and what a
        DecodeStep can carry when it needs no rollback)."""
        return self.decode and self.token_count == 1

    @property
    def end(self) -> int:
        """The position after its last token: the cache length once it is applied."""
        return self.first_position + self.token_count


@dataclass(frozen=True, slots=True)
class Deadline:
    """A unit's deadline on both clocks.

    ``unix_ns`` is the instant as the envelope carries it (``deadline_unix_nanos``: wall-clock,
    so every hop reads the same instant); ``at_ns`` is that instant on the monotonic clock this
    process's timers run on, fixed once, when the deadline arrived. A wall-clock step after that
    moves neither the unit's timer nor the lease it sized.
    """

    unix_ns: int
    at_ns: int

    @classmethod
    def from_unix(cls, unix_ns: int, *, now_ns: int, unix_now_ns: int) -> Deadline | None:
        """The deadline ``unix_ns`` (0: none, as on the wire), read at monotonic ``now_ns``, which
        was wall-clock ``unix_now_ns``."""
        if unix_ns == 0:
            return None
        return cls(unix_ns, now_ns + (unix_ns - unix_now_ns))


def later(deadline: Deadline | None, by_ns: int) -> Deadline | None:
    """``deadline`` moved ``by_ns`` later on both clocks (None stays None)."""
    if deadline is None or by_ns == 0:
        return deadline
    return Deadline(deadline.unix_ns + by_ns, deadline.at_ns + by_ns)


def wire_deadline(deadline: Deadline | None) -> int:
    """``deadline_unix_nanos`` for an envelope or decode step (0: none)."""
    return 0 if deadline is None else deadline.unix_ns


def unit_position(envelope: shard.Envelope) -> UnitPosition:
    """Read an ActivationChunk's phase, position, cache expectation and chunk info together.

    A prefill chunk at position 0 with cache mode PREFILL (or STATELESS, run the
    same way) starts fresh; a later chunk uses mode DECODE expecting exactly its
    first position; a decode unit is one token with mode DECODE at its position,
    or (speculative decoding) one token and ``draft_tokens`` drafts; only a decode
    unit may ask for a rollback.
    """
    first, count = envelope.position.first_position, envelope.position.token_count
    if count < 1:
        raise payload_corrupt("a unit carries at least one token position")
    expectation = envelope.cache_expectation
    drafts = envelope.draft_tokens
    block_digest, prefix_digest = envelope.block_digest, expectation.prefix_digest
    if len(block_digest) > MAX_PREFIX_DIGEST_BYTES or len(prefix_digest) > MAX_PREFIX_DIGEST_BYTES:
        raise payload_corrupt(f"a prefix digest has at most {MAX_PREFIX_DIGEST_BYTES} bytes")
    if envelope.phase != shard.PHASE_PREFILL and (block_digest or prefix_digest):
        raise payload_corrupt("only a prefill unit completes a block or starts from a kept prefix")
    if envelope.phase != shard.PHASE_DECODE and (drafts or expectation.rollback):
        raise payload_corrupt("only a decode unit carries drafts or a rollback")
    if drafts > MAX_DRAFT_TOKENS:
        raise payload_corrupt(f"a verify step carries at most {MAX_DRAFT_TOKENS} draft tokens")
    if envelope.phase == shard.PHASE_PREFILL:
        info = envelope.chunk
        if info.chunk_count < 1 or info.chunk_index >= info.chunk_count:
            raise payload_corrupt("prefill chunk info is missing or out of range")
        if info.final_chunk != (info.chunk_index == info.chunk_count - 1):
            raise payload_corrupt("final_chunk disagrees with the chunk index")
        if expectation.mode in (shard.CACHE_MODE_PREFILL, shard.CACHE_MODE_STATELESS):
            if first != 0:
                raise payload_corrupt("a fresh prefill starts at position 0")
            if prefix_digest:
                raise payload_corrupt("a fresh prefill starts from nothing kept")
            return UnitPosition(
                False, first, count, None, info.chunk_index, info.chunk_count, block_digest=block_digest
            )
        if expectation.mode == shard.CACHE_MODE_DECODE:
            if expectation.expected_past_len != first:
                raise payload_corrupt("a continued prefill expects the cache to hold its first position")
            return UnitPosition(
                False,
                first,
                count,
                first,
                info.chunk_index,
                info.chunk_count,
                block_digest=block_digest,
                prefix_digest=prefix_digest,
            )
        raise payload_corrupt("envelope has no cache expectation")
    if envelope.phase == shard.PHASE_DECODE:
        if (
            expectation.mode != shard.CACHE_MODE_DECODE
            or count != 1 + drafts
            or expectation.expected_past_len != first
        ):
            raise payload_corrupt(
                "a decode unit is one token (and its drafts) continuing the cache at its position"
            )
        return UnitPosition(True, first, count, first, draft_tokens=drafts, rollback=expectation.rollback)
    raise payload_corrupt("a unit's phase must be PREFILL or DECODE")


__all__ = [
    "HIGHEST_SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "Deadline",
    "UnitPosition",
    "digests",
    "later",
    "range_tuple",
    "unit_position",
    "wire_deadline",
]
