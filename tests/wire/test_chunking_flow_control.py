import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.wire.chunking import CHUNK_OVERHEAD_BYTES, plan_prefill_chunks, tokens_per_chunk
from meshnode.wire.flow_control import (
    MAX_CHUNK_BYTES_CEILING,
    default_flow_control,
    negotiate_flow_control,
)
from meshnode.wire.pb import shard


@given(n=st.integers(1, 5000), start=st.integers(0, 10_000), bound=st.integers(1, 300))
def test_chunks_tile_the_prompt_token_aligned_and_bounded(n, start, bound):
    chunks = plan_prefill_chunks(n, first_position=start, max_prefill_chunk_tokens=bound)
    assert chunks[0].first_position == start
    assert sum(c.token_count for c in chunks) == n
    for before, after in itertools.pairwise(chunks):
        assert after.first_position == before.end_position
    assert all(1 <= c.token_count <= bound for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.count == len(chunks) for c in chunks)
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks) == -(-n // bound)


def test_default_bound_is_128_tokens():
    chunks = plan_prefill_chunks(300)
    assert [c.token_count for c in chunks] == [100, 100, 100]
    assert (chunks[-1].index, chunks[-1].count, chunks[-1].final) == (2, 3, True)
    assert (chunks[1].first_position, chunks[1].end_position) == (100, 200)
    assert [c.token_count for c in plan_prefill_chunks(128)] == [128]
    assert len(plan_prefill_chunks(129)) == 2


def test_byte_bound_keeps_chunks_under_max_chunk_bytes():
    per_token = 4096 * 4  # float32 hidden state at n_embd 4096
    bound = tokens_per_chunk(128, bytes_per_token=per_token, max_chunk_bytes=1 << 20)
    assert bound * per_token + CHUNK_OVERHEAD_BYTES <= 1 << 20
    assert bound == (1 << 20) // per_token - 1
    with pytest.raises(ValueError, match="does not fit"):
        tokens_per_chunk(128, bytes_per_token=1 << 20, max_chunk_bytes=1 << 20)
    with pytest.raises(ValueError):
        plan_prefill_chunks(0)


def fc(credits=0, inflight=0, chunk_bytes=0, tokens=0):
    return shard.FlowControl(
        credits_granted=credits,
        max_inflight_chunks=inflight,
        max_chunk_bytes=chunk_bytes,
        max_prefill_chunk_tokens=tokens,
    )


def test_each_field_takes_the_stricter_value():
    settled = negotiate_flow_control(fc(8, 16, 1 << 20, 64), fc(4, 32, 1 << 22, 128))
    assert (settled.credits_granted, settled.max_inflight_chunks) == (4, 16)
    assert (settled.max_chunk_bytes, settled.max_prefill_chunk_tokens) == (1 << 20, 64)
    assert negotiate_flow_control(fc(4, 32, 1 << 22, 128), fc(8, 16, 1 << 20, 64)) == settled


def test_initial_credits_are_capped_by_max_inflight():
    settled = negotiate_flow_control(fc(credits=50, inflight=6), fc(credits=40, inflight=10))
    assert settled.credits_granted == 6


def test_zero_means_no_preference_and_the_frame_cap_bounds_chunk_bytes():
    settled = negotiate_flow_control(fc(), default_flow_control())
    assert settled == default_flow_control()
    huge = negotiate_flow_control(fc(chunk_bytes=1 << 40), fc(chunk_bytes=1 << 41))
    assert huge.max_chunk_bytes == MAX_CHUNK_BYTES_CEILING
    assert huge.credits_granted >= 1 and huge.max_inflight_chunks >= 1
