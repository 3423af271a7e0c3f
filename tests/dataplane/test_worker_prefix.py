"""The worker's part of the prefix cache: a session's first unit may start from a prefix the
engine kept, block digests reach the engine, and the envelope's new fields are checked."""

from __future__ import annotations

import pytest
from helpers.recording_engine import RecordingEngine

from engines.interface import METRIC_PREFIX_HITS
from meshnode.wire.pb import shard

from .harness import WorkerHarness, acks, chunk_request, kinds, only_status, reference, result_tokens

PROMPT = [(5 * i) % 29 + 1 for i in range(12)]
BLOCK_A, BLOCK_B = b"a" * 16, b"b" * 16


def with_digests(
    request: shard.SessionRequest, *, block: bytes = b"", prefix: bytes = b""
) -> shard.SessionRequest:
    request.chunk.envelope.block_digest = block
    request.chunk.envelope.cache_expectation.prefix_digest = prefix
    return request


def kept_prefix_harness() -> WorkerHarness:
    """A worker whose engine kept the first 8 positions of PROMPT (two blocks of 4) from session s0."""
    harness = WorkerHarness(RecordingEngine(prefix_cache_entries=2))
    stream, _ = harness.open(session_id="s0")
    harness.ask(
        stream, with_digests(chunk_request(1, PROMPT[:4], session_id="s0", chunk=(0, 3)), block=BLOCK_A)
    )
    harness.ask(
        stream,
        with_digests(
            chunk_request(2, PROMPT[4:8], first_position=4, session_id="s0", chunk=(1, 3)), block=BLOCK_B
        ),
    )
    harness.ask(stream, chunk_request(3, PROMPT[8:10], first_position=8, session_id="s0", chunk=(2, 3)))
    released, actions = harness.release("s0", 1, harness.now)
    assert released
    harness.run(actions)
    return harness


def test_a_first_unit_naming_a_kept_prefix_continues_it_and_a_retry_is_replayed_not_reapplied() -> None:
    harness = kept_prefix_harness()
    stream, _ = harness.open(session_id="s1")
    seeding = with_digests(chunk_request(1, PROMPT[8:], first_position=8, session_id="s1"), prefix=BLOCK_B)
    first = harness.ask(stream, seeding)
    assert kinds(first)[:2] == ["chunk", "ack"]
    assert acks(first)[0].cache_result.past_len == len(PROMPT)
    # The token a fresh prefill of the whole prompt samples.
    assert result_tokens(first) == reference(PROMPT, 0)
    seeded = harness.engine.calls[-1]
    assert seeded.prefix_digest == BLOCK_B and seeded.first_position == 8
    calls = len(harness.engine.calls)
    again = harness.ask(stream, seeding)
    assert acks(again)[0].duplicate and acks(again)[0].cache_result.past_len == len(PROMPT)
    assert result_tokens(again) == result_tokens(first)
    assert len(harness.engine.calls) == calls
    assert harness.engine.metrics()[METRIC_PREFIX_HITS] == 1


def test_a_first_unit_naming_a_prefix_not_kept_is_a_cache_miss_at_length_zero() -> None:
    harness = kept_prefix_harness()
    stream, _ = harness.open(session_id="s1")
    status = only_status(
        harness.ask(
            stream,
            with_digests(chunk_request(1, PROMPT[8:], first_position=8, session_id="s1"), prefix=b"x" * 16),
        )
    )
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS
    assert status.error.actual_past_len == 0 and not status.terminal
    # A fresh prefill from 0 on the same stream then answers as always.
    out = harness.ask(stream, chunk_request(2, PROMPT, session_id="s1"))
    assert result_tokens(out) == reference(PROMPT, 0)


def test_without_a_prefix_digest_a_continued_prefill_of_an_unknown_session_stays_a_miss() -> None:
    harness = kept_prefix_harness()
    stream, _ = harness.open(session_id="s1")
    status = only_status(harness.ask(stream, chunk_request(1, PROMPT[8:], first_position=8, session_id="s1")))
    assert status.error.code == shard.ERROR_CODE_CACHE_MISS and status.error.actual_past_len == 0
    # Refused by what the worker knows (a new session holds nothing): the engine never ran it.
    assert len(harness.engine.calls) == 3


@pytest.mark.parametrize(
    "build",
    [
        # A fresh prefill starts from nothing kept.
        lambda: with_digests(chunk_request(1, PROMPT[:4]), prefix=BLOCK_A),
        # Only a prefill unit completes a block.
        lambda: with_digests(
            chunk_request(1, PROMPT[:1], first_position=4, phase=shard.PHASE_DECODE), block=BLOCK_A
        ),
        # A digest is at most 32 bytes.
        lambda: with_digests(chunk_request(1, PROMPT[:4]), block=b"z" * 33),
        lambda: with_digests(chunk_request(1, PROMPT[:4], first_position=4), prefix=b"z" * 33),
    ],
)
def test_the_prefix_fields_are_checked(build) -> None:
    harness = WorkerHarness(RecordingEngine(prefix_cache_entries=2))
    stream, _ = harness.open()
    status = only_status(harness.ask(stream, build()))
    assert status.error.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert harness.engine.calls == []
