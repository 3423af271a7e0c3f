import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.wire.errors import FrameTooLarge, FramingError, TruncatedFrame, UnknownStreamType
from meshnode.wire.framing import (
    LENGTH_PREFIX_BYTES,
    MAX_FRAME_BYTES,
    FrameDecoder,
    StreamType,
    encode_frame,
    encode_stream_open,
    frame_header,
)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


bodies = st.lists(st.binary(max_size=300), max_size=12)


@given(bodies=bodies, cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=30))
def test_any_split_of_a_stream_decodes_to_the_same_frames(bodies, cuts):
    stream = encode_stream_open(StreamType.GOSSIP) + b"".join(encode_frame(b) for b in bodies)
    decoder = FrameDecoder(expect_stream_type=True)
    frames = []
    for piece in split_at(stream, cuts):
        frames.extend(decoder.feed(piece))
    decoder.end_of_stream()
    assert decoder.stream_type is StreamType.GOSSIP
    assert frames == bodies


@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=10))
@settings(max_examples=300)
def test_garbage_yields_only_typed_errors_and_bounded_buffering(data, cuts):
    decoder = FrameDecoder(expect_stream_type=True, max_frame_bytes=1024)
    try:
        for piece in split_at(data, cuts):
            decoder.feed(piece)
            assert decoder.buffered_bytes <= 1024 + LENGTH_PREFIX_BYTES
        decoder.end_of_stream()
    except FramingError:
        pass


def test_oversized_prefix_is_refused_after_the_five_header_bytes():
    oversized = bytes([StreamType.GOSSIP]) + struct.pack("<I", MAX_FRAME_BYTES + 1)
    decoder = FrameDecoder(expect_stream_type=True)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(oversized + b"x" * 100_000)
    assert info.value.length == MAX_FRAME_BYTES + 1
    assert decoder.buffered_bytes == 0


def test_encoder_refuses_before_producing_any_byte():
    with pytest.raises(FrameTooLarge):
        frame_header(MAX_FRAME_BYTES + 1)
    with pytest.raises(FrameTooLarge):
        encode_frame(b"\0" * (MAX_FRAME_BYTES + 1))
    assert len(encode_frame(b"\0" * MAX_FRAME_BYTES)) == MAX_FRAME_BYTES + LENGTH_PREFIX_BYTES


def test_unknown_stream_type_and_the_decoder_stays_failed():
    decoder = FrameDecoder(expect_stream_type=True)
    with pytest.raises(UnknownStreamType) as info:
        decoder.feed(b"\x03" + encode_frame(b"x"))
    assert info.value.value == 0x03
    with pytest.raises(UnknownStreamType):
        decoder.feed(encode_frame(b"y"))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", (0, 1)),
        (bytes([StreamType.GOSSIP]) + b"\x05\x00", (2, 4)),
        (bytes([StreamType.GOSSIP]) + encode_frame(b"abcdef")[:-1], (5, 6)),
    ],
)
def test_end_of_stream_inside_a_frame_is_truncation(data, expected):
    decoder = FrameDecoder(expect_stream_type=True)
    decoder.feed(data)
    with pytest.raises(TruncatedFrame) as info:
        decoder.end_of_stream()
    assert (info.value.buffered, info.value.expected) == expected


def test_reply_direction_has_no_type_byte():
    decoder = FrameDecoder(expect_stream_type=False)
    assert decoder.feed(encode_frame(b"\x01\x02")) == [b"\x01\x02"]
    assert decoder.stream_type is None
    assert decoder.at_frame_boundary


def test_large_frame_fed_in_small_pieces():
    body = bytes(range(256)) * 4096
    wire = encode_frame(body)
    decoder = FrameDecoder(expect_stream_type=False)
    frames = []
    for offset in range(0, len(wire), 1200):
        frames.extend(decoder.feed(wire[offset : offset + 1200]))
    assert frames == [body]
