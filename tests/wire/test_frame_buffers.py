"""A decoder's buffer grows with the bytes that arrive, and what it holds is charged to budgets."""

from __future__ import annotations

import gc
import struct
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.wire.buffer_budget import BufferBudget, BufferScope
from meshnode.wire.errors import BufferLimitExceeded, FramingError, TruncatedFrame
from meshnode.wire.framing import MAX_FRAME_BYTES, FrameDecoder, StreamType, encode_frame

KiB = 1024


def announce(length: int, body: bytes = b"") -> bytes:
    return struct.pack("<I", length) + body


def budgets(connection: int, process: int) -> tuple[BufferBudget, BufferBudget]:
    root = BufferBudget(process, scope=BufferScope.PROCESS)
    return root, root.child(connection)


def test_an_announced_length_allocates_nothing_until_its_bytes_arrive() -> None:
    decoder = FrameDecoder(expect_stream_type=True)
    tracemalloc.start()
    try:
        decoder.feed(bytes([StreamType.GOSSIP]) + announce(MAX_FRAME_BYTES, b"abc"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder.buffered_bytes == 3
    assert peak < 64 * KiB, peak  # bytearray(8 MiB) would show here as 8 MiB


def test_a_frame_arriving_in_pieces_is_whole_and_its_charge_returned() -> None:
    root, connection = budgets(connection=64 * KiB, process=64 * KiB)
    decoder = FrameDecoder(expect_stream_type=False, budget=connection)
    body = bytes(range(256)) * 100
    data = encode_frame(body)
    frames = []
    for start in range(0, len(data), 1000):
        frames += decoder.feed(data[start : start + 1000])
        assert connection.held == root.held == decoder.buffered_bytes
    assert frames == [body]
    assert connection.held == root.held == 0


@given(
    bodies=st.lists(st.binary(max_size=600), max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=97), min_size=1, max_size=40),
)
def test_the_charge_is_exactly_the_body_bytes_held(bodies: list[bytes], cuts: list[int]) -> None:
    root, connection = budgets(connection=1 << 20, process=1 << 20)
    decoder = FrameDecoder(expect_stream_type=False, budget=connection)
    data = b"".join(encode_frame(b) for b in bodies)
    frames, pos, i = [], 0, 0
    while pos < len(data):
        step = cuts[i % len(cuts)]
        frames += decoder.feed(data[pos : pos + step])
        pos, i = pos + step, i + 1
        header_bytes = decoder.buffered_bytes - connection.held
        assert 0 <= header_bytes < 4 and root.held == connection.held
    assert frames == bodies
    assert connection.held == 0


def test_past_the_connection_cap_the_decoder_fails_and_holds_nothing() -> None:
    root, connection = budgets(connection=10 * KiB, process=1 << 20)
    other = FrameDecoder(expect_stream_type=False, budget=connection)
    other.feed(announce(8 * KiB, b"x" * 6 * KiB))
    decoder = FrameDecoder(expect_stream_type=False, budget=connection)
    decoder.feed(announce(8 * KiB, b"y" * 3 * KiB))
    with pytest.raises(BufferLimitExceeded) as refused:
        decoder.feed(b"y" * 2 * KiB)
    assert refused.value.scope == BufferScope.CONNECTION
    assert (refused.value.held, refused.value.wanted, refused.value.limit) == (9 * KiB, 2 * KiB, 10 * KiB)
    assert connection.held == root.held == 6 * KiB  # the other stream's bytes, nothing of this one
    with pytest.raises(BufferLimitExceeded):
        decoder.feed(b"more")  # stays failed
    assert other.feed(b"x" * 2 * KiB) == [b"x" * 8 * KiB]
    assert connection.held == 0


def test_past_the_process_cap_the_scope_is_the_process() -> None:
    root = BufferBudget(10 * KiB, scope=BufferScope.PROCESS)
    first, second = root.child(8 * KiB), root.child(8 * KiB)
    holding = FrameDecoder(expect_stream_type=False, budget=first)
    holding.feed(announce(8 * KiB, b"a" * 7 * KiB))
    decoder = FrameDecoder(expect_stream_type=False, budget=second)
    with pytest.raises(BufferLimitExceeded) as refused:
        decoder.feed(announce(8 * KiB, b"b" * 4 * KiB))
    assert refused.value.scope == BufferScope.PROCESS
    assert (first.held, second.held, root.held) == (7 * KiB, 0, 7 * KiB)


def test_a_whole_frame_in_one_chunk_is_never_charged() -> None:
    _, connection = budgets(connection=1, process=1)
    decoder = FrameDecoder(expect_stream_type=False, budget=connection)
    assert decoder.feed(encode_frame(b"z" * 5000)) == [b"z" * 5000]


def test_abandoning_truncation_and_garbage_collection_give_the_charge_back() -> None:
    root, connection = budgets(connection=1 << 20, process=1 << 20)
    abandoned = FrameDecoder(expect_stream_type=False, budget=connection)
    abandoned.feed(announce(1000, b"a" * 100))
    abandoned.abandon()
    assert root.held == 0
    with pytest.raises(FramingError):
        abandoned.feed(b"a")

    truncated = FrameDecoder(expect_stream_type=False, budget=connection)
    truncated.feed(announce(1000, b"t" * 100))
    with pytest.raises(TruncatedFrame):
        truncated.end_of_stream()
    assert root.held == 0

    dropped = FrameDecoder(expect_stream_type=False, budget=connection)
    dropped.feed(announce(1000, b"d" * 100))
    assert root.held == 100
    del dropped
    gc.collect()
    assert connection.held == root.held == 0


def test_a_budget_refuses_a_negative_limit() -> None:
    with pytest.raises(ValueError):
        BufferBudget(-1, scope=BufferScope.PROCESS)
