import random
import tracemalloc

import numpy as np
import pytest
import zstandard
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import (
    NUMPY_DTYPES,
    DecodeLimits,
    bfloat16_bits_to_float32,
    decode_bundle,
    decode_tensor,
    encode_bundle,
    encode_float_tensor,
    encode_tensor,
    float32_to_bfloat16_bits,
)

COMPRESSIONS = [shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD]


def wire_array(dtype: int, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    np_dtype = NUMPY_DTYPES[dtype]
    count = int(np.prod(shape)) if shape else 1
    data = (raw * (count * np_dtype.itemsize // max(1, len(raw)) + 1))[: count * np_dtype.itemsize]
    if dtype == shard.DTYPE_BOOL:
        return (np.frombuffer(data, np.uint8) & 1).astype(bool).reshape(shape)
    return np.frombuffer(data, np_dtype).reshape(shape)


@given(
    dtype=st.sampled_from(sorted(NUMPY_DTYPES)),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple),
    raw=st.binary(min_size=1, max_size=64),
    compression=st.sampled_from(COMPRESSIONS),
    fragment_bytes=st.integers(16, 200),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=300, deadline=None)
def test_any_tensor_round_trips_bit_exactly(dtype, shape, raw, compression, fragment_bytes, seed):
    array = wire_array(dtype, shape, raw)
    tensor = encode_tensor("t", dtype, array, compression=compression, max_fragment_bytes=fragment_bytes)
    # Arrival order must not matter: the decoder proves tiling by byte_offset.
    fragments = list(tensor.fragments)
    random.Random(seed).shuffle(fragments)
    del tensor.fragments[:]
    tensor.fragments.extend(fragments)
    wire = tensor.SerializeToString()
    decoded = decode_tensor(shard.NamedTensor.FromString(wire))
    assert decoded.dtype == dtype
    assert decoded.array.shape == shape
    assert decoded.array.tobytes() == np.ascontiguousarray(array).tobytes()


@given(
    tensors=st.lists(
        st.tuples(st.sampled_from(sorted(NUMPY_DTYPES)), st.integers(0, 40), st.sampled_from(COMPRESSIONS)),
        min_size=1,
        max_size=5,
    ),
)
@settings(max_examples=100, deadline=None)
def test_any_bundle_round_trips(tensors):
    arrays = {
        f"t{i}": (dtype, wire_array(dtype, (n,), bytes(range(1, 200))), comp)
        for i, (dtype, n, comp) in enumerate(tensors)
    }
    bundle = encode_bundle(
        encode_tensor(name, dtype, arr, compression=comp, max_fragment_bytes=16)
        for name, (dtype, arr, comp) in arrays.items()
    )
    wire = bundle.SerializeToString()
    decoded = decode_bundle(shard.TensorBundle.FromString(wire))
    assert decoded.keys() == arrays.keys()
    for name, (_, arr, _) in arrays.items():
        assert decoded[name].array.tobytes() == arr.tobytes()


def reference_bfloat16(value: np.float32) -> int:
    """Nearest bfloat16 with ties to even, computed the slow obvious way."""
    bits = int(np.array([value], dtype="<f4").view("<u4")[0])
    if np.isnan(value):
        return (bits >> 16) | 0x40
    lower = bits >> 16
    remainder = bits & 0xFFFF
    if remainder > 0x8000 or (remainder == 0x8000 and lower & 1):
        return lower + 1
    return lower


@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
@settings(max_examples=500)
def test_bfloat16_rounds_to_nearest_even(value):
    converted = float32_to_bfloat16_bits(np.array([value], dtype=np.float32))
    assert int(converted[0]) == reference_bfloat16(np.float32(value))


def test_bfloat16_known_values():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan], dtype=np.float32)
    bits = float32_to_bfloat16_bits(values)
    back = bfloat16_bits_to_float32(bits)
    # 1 + 2^-8 is a tie and rounds down to the even 1.0; 1 + 3*2^-8 rounds up.
    assert back[:5].tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf]
    assert np.isnan(back[5])


def test_float_boundary_helper_bf16_halves_the_bytes():
    hidden = np.linspace(-3, 3, 640, dtype=np.float32).reshape(1, 640)
    f32 = encode_float_tensor("hidden_states", hidden, shard.DTYPE_FLOAT32)
    bf16 = encode_float_tensor("hidden_states", hidden, shard.DTYPE_BFLOAT16)
    assert bf16.total_bytes * 2 == f32.total_bytes
    assert np.array_equal(decode_tensor(f32).as_float32(), hidden)
    approx = decode_tensor(bf16).as_float32()
    assert np.max(np.abs(approx - hidden) / np.maximum(np.abs(hidden), 1e-3)) < 2**-8


# --------------------------------------------------------------------------
# Refusals: every one is a PayloadCorrupt with the PAYLOAD_CORRUPT code.
# --------------------------------------------------------------------------


def sample_tensor(compression=shard.COMPRESSION_NONE, fragment_bytes=64) -> shard.NamedTensor:
    array = np.arange(96, dtype=np.float32).reshape(2, 48)
    return encode_tensor(
        "hidden_states",
        shard.DTYPE_FLOAT32,
        array,
        compression=compression,
        max_fragment_bytes=fragment_bytes,
    )


def assert_corrupt(tensor: shard.NamedTensor, match: str, limits: DecodeLimits | None = None) -> None:
    # Through the wire, as a receiver would see it.
    received = shard.NamedTensor.FromString(tensor.SerializeToString())
    with pytest.raises(PayloadCorrupt, match=match) as info:
        decode_tensor(received, limits or DecodeLimits())
    assert info.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
    assert info.value.to_pb().code == shard.ERROR_CODE_PAYLOAD_CORRUPT


def test_flipped_bit_fails_the_checksum():
    tensor = sample_tensor()
    payload = bytearray(tensor.fragments[1].payload)
    payload[3] ^= 0x10
    tensor.fragments[1].payload = bytes(payload)
    assert_corrupt(tensor, "checksum mismatch")


def test_flipped_bit_in_a_compressed_body_is_refused():
    tensor = sample_tensor(shard.COMPRESSION_ZSTD, fragment_bytes=1 << 20)
    payload = bytearray(tensor.fragments[0].payload)
    payload[-3] ^= 0x01
    tensor.fragments[0].payload = bytes(payload)
    with pytest.raises(PayloadCorrupt):
        decode_tensor(tensor)


def test_fragment_hole_overlap_and_index_mismatch():
    hole = sample_tensor()
    del hole.fragments[1]
    for fragment in hole.fragments:
        fragment.fragment_count = len(hole.fragments)
    hole.fragments[1].fragment_index = 1
    assert_corrupt(hole, "hole")

    overlap = sample_tensor()
    overlap.fragments[2].byte_offset -= 8
    assert_corrupt(overlap, "overlap")

    swapped = sample_tensor()
    swapped.fragments[0].fragment_index, swapped.fragments[1].fragment_index = 1, 0
    assert_corrupt(swapped, "indices")

    short = sample_tensor()
    short.fragments[-1].payload = short.fragments[-1].payload[:-4]
    assert_corrupt(short, "cover")

    none = sample_tensor()
    del none.fragments[:]
    assert_corrupt(none, "0 fragments")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", shard.DTYPE_UNSPECIFIED, "dtype"),
        ("dtype", 99, "dtype"),
        ("byte_order", shard.BYTE_ORDER_BIG_ENDIAN, "BYTE_ORDER_BIG_ENDIAN"),
        ("byte_order", shard.BYTE_ORDER_UNSPECIFIED, "byte order"),
        ("compression", shard.COMPRESSION_UNSPECIFIED, "compression"),
        ("name", "", "name"),
    ],
)
def test_unspecified_and_big_endian_are_refused(field, value, match):
    tensor = sample_tensor()
    setattr(tensor, field, value)
    assert_corrupt(tensor, match)


def test_checksum_must_be_present_and_well_formed():
    missing = sample_tensor()
    missing.checksum.algorithm = shard.CHECKSUM_ALGORITHM_UNSPECIFIED
    assert_corrupt(missing, "checksum")
    none = sample_tensor()
    none.checksum.algorithm = shard.CHECKSUM_ALGORITHM_NONE
    assert_corrupt(none, "checksum")
    assert decode_tensor(none, DecodeLimits(require_checksum=False)).array.shape == (2, 48)
    short = sample_tensor()
    short.checksum.value = b"\x00\x01"
    assert_corrupt(short, "4 bytes")


def test_bad_shapes_and_budgets():
    mismatch = sample_tensor()
    mismatch.shape[:] = [2, 47]
    assert_corrupt(mismatch, "shape")
    negative = sample_tensor()
    negative.shape[:] = [-2, -48]
    assert_corrupt(negative, "negative")
    deep = sample_tensor()
    deep.shape[:] = [1] * 9 + [96]
    assert_corrupt(deep, "rank")
    assert_corrupt(sample_tensor(), "over budget", DecodeLimits(max_tensor_bytes=100))
    assert_corrupt(sample_tensor(), "fragments", DecodeLimits(max_fragments=2))


def test_huge_declared_size_is_refused_without_allocating():
    tensor = sample_tensor()
    tensor.shape[:] = [1 << 40, 1 << 20]
    tensor.total_bytes = (1 << 60) * 4
    tracemalloc.start()
    try:
        with pytest.raises(PayloadCorrupt, match="over budget"):
            decode_tensor(tensor)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_zstd_frame_must_declare_exactly_total_bytes():
    raw = bytes(4096)
    tensor = sample_tensor(shard.COMPRESSION_ZSTD)
    tensor.shape[:] = [1024]
    tensor.total_bytes = len(raw)
    tensor.checksum.value = b"\0\0\0\0"
    del tensor.fragments[:]

    def with_body(body: bytes) -> shard.NamedTensor:
        copy = shard.NamedTensor()
        copy.CopyFrom(tensor)
        copy.fragments.add(fragment_index=0, fragment_count=1, byte_offset=0, payload=body)
        return copy

    # A bomb: declares far more than total_bytes.
    bomb = zstandard.ZstdCompressor().compress(bytes(64 * 1024 * 1024))
    assert_corrupt(with_body(bomb), "declare total_bytes")
    # No declared size at all.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert_corrupt(with_body(unsized), "declare total_bytes")
    # Trailing bytes after the frame.
    sized = zstandard.ZstdCompressor().compress(raw)
    assert_corrupt(with_body(sized + b"junk"), "extent")
    # Not zstd at all.
    assert_corrupt(with_body(b"not a zstd frame at all"), "zstd")


def test_zstd_window_is_bounded():
    raw = np.random.default_rng(1).integers(0, 4, size=1 << 21, dtype=np.uint8).tobytes()
    tensor = encode_tensor(
        "t", shard.DTYPE_UINT8, np.frombuffer(raw, np.uint8), compression=shard.COMPRESSION_ZSTD
    )
    big_window = zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(window_log=21, write_content_size=True)
    ).compress(raw)
    del tensor.fragments[:]
    tensor.fragments.add(fragment_index=0, fragment_count=1, byte_offset=0, payload=big_window)
    assert decode_tensor(tensor).array.nbytes == len(raw)
    assert_corrupt(tensor, "window", DecodeLimits(max_zstd_window=1 << 17))


def test_bool_payload_must_be_zero_or_one():
    tensor = encode_tensor("mask", shard.DTYPE_BOOL, np.array([True, False, True]))
    assert decode_tensor(tensor).array.tolist() == [True, False, True]
    tensor = encode_tensor("mask", shard.DTYPE_UINT8, np.array([1, 0, 7], dtype=np.uint8))
    tensor.dtype = shard.DTYPE_BOOL
    assert_corrupt(tensor, "bool")


def test_bundle_level_refusals():
    tensor = sample_tensor()
    with pytest.raises(PayloadCorrupt, match="version"):
        decode_bundle(shard.TensorBundle(bundle_version=0, tensors=[tensor]))
    with pytest.raises(PayloadCorrupt, match="twice"):
        decode_bundle(encode_bundle([tensor, tensor]))
    with pytest.raises(PayloadCorrupt, match="tensors"):
        decode_bundle(encode_bundle([tensor] * 3), DecodeLimits(max_tensors=2))
    with pytest.raises(PayloadCorrupt, match="bundle of"):
        decode_bundle(encode_bundle([tensor]), DecodeLimits(max_bundle_bytes=10))


@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 8), cut=st.integers(0, 2000))
@settings(max_examples=300, deadline=None)
def test_mutated_or_truncated_bytes_never_raise_anything_untyped(seed, flips, cut):
    rng = random.Random(seed)
    wire = bytearray(
        encode_bundle(
            [sample_tensor(rng.choice(COMPRESSIONS), fragment_bytes=rng.choice([32, 500]))]
        ).SerializeToString()
    )
    for _ in range(flips):
        wire[rng.randrange(len(wire))] = rng.randrange(256)
    wire = wire[: max(1, cut)] if rng.random() < 0.3 else wire
    try:
        bundle = shard.TensorBundle.FromString(bytes(wire))
    except DecodeError:
        return  # the transport refuses it before the codec sees it
    tracemalloc.start()
    try:
        decode_bundle(bundle)
    except PayloadCorrupt:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 << 20
