"""The in-place bundle reader decodes exactly what the protobuf runtime decodes, without copying."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.wire.bundle_reader import read_activation_chunk, read_bundle
from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import (
    DEFAULT_LIMITS,
    NUMPY_DTYPES,
    WireTensor,
    decode_bundle,
    decode_bundle_bytes,
    encode_bundle,
    encode_tensor,
)

COMPRESSIONS = [shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD]


def through_protobuf(wire: bytes) -> dict[str, WireTensor]:
    """What a receiver that parses with the protobuf runtime decodes."""
    try:
        bundle = shard.TensorBundle.FromString(wire)
    except DecodeError:
        raise PayloadCorrupt("not a TensorBundle") from None
    return decode_bundle(bundle)


def outcome(decode, wire: bytes) -> object:
    try:
        tensors = decode(wire)
    except PayloadCorrupt as error:
        return ("refused", error.code)
    return {name: (t.dtype, t.array.shape, t.array.tobytes()) for name, t in tensors.items()}


def sample_bundle(draw_tensors: list[tuple[int, int, int, int]]) -> bytes:
    tensors = []
    for index, (dtype, length, compression, fragment_bytes) in enumerate(draw_tensors):
        raw = bytes((i * 7 + index) % 251 for i in range(length * NUMPY_DTYPES[dtype].itemsize))
        array = np.frombuffer(raw, NUMPY_DTYPES[dtype]).reshape(length)
        if dtype == shard.DTYPE_BOOL:
            array = (array.view(np.uint8) & 1).astype(bool)
        tensors.append(
            encode_tensor(
                f"t{index}", dtype, array, compression=compression, max_fragment_bytes=fragment_bytes
            )
        )
    return encode_bundle(tensors).SerializeToString()


bundles = st.lists(
    st.tuples(
        st.sampled_from(sorted(NUMPY_DTYPES)),
        st.integers(0, 60),
        st.sampled_from(COMPRESSIONS),
        st.integers(8, 300),
    ),
    min_size=1,
    max_size=4,
).map(sample_bundle)


@given(wire=bundles)
@settings(max_examples=200, deadline=None)
def test_encoder_output_is_read_in_place_and_decodes_like_protobuf(wire: bytes) -> None:
    assert read_bundle(wire, DEFAULT_LIMITS) is not None  # the encoder's output never needs protobuf
    assert outcome(decode_bundle_bytes, wire) == outcome(through_protobuf, wire)


@given(
    wire=bundles,
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
)
@settings(max_examples=600, deadline=None)
def test_mutated_bundles_get_the_same_answer_either_way(
    wire: bytes, edits: list[tuple[int, int]], cut: int | None
) -> None:
    mutated = bytearray(wire)
    for position, value in edits:
        mutated[position % len(mutated)] = value
    if cut is not None:
        del mutated[cut % len(mutated) :]
    data = bytes(mutated)
    assert outcome(decode_bundle_bytes, data) == outcome(through_protobuf, data)


@pytest.mark.parametrize("extra", [b"", b"\x18\x05", b"\x12\x00\x12\x00"])
def test_arbitrary_bytes_never_raise_anything_but_payload_corrupt(extra: bytes) -> None:
    rng = random.Random(5)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(40))) + extra
        assert outcome(decode_bundle_bytes, data) == outcome(through_protobuf, data)


def test_a_single_fragment_decodes_to_a_view_of_the_received_bytes() -> None:
    array = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024)
    wire = encode_bundle([encode_tensor("hidden_states", shard.DTYPE_FLOAT32, array)]).SerializeToString()
    decoded = decode_bundle_bytes(wire)["hidden_states"].array
    assert np.array_equal(decoded, array)
    assert np.shares_memory(decoded, np.frombuffer(wire, np.uint8))
    assert not decoded.flags.writeable  # a view of immutable bytes cannot be scribbled on


def unknown_field(number: int) -> bytes:
    return bytes([(number << 3) | 0, 1])


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def bundle_of(tensor_body: bytes) -> bytes:
    """A serialized bundle (version 1) around one hand-made NamedTensor body."""
    return b"\x08\x01\x12" + varint(len(tensor_body)) + tensor_body


def test_encodings_outside_the_canonical_subset_go_through_protobuf() -> None:
    tensor = encode_tensor("t", shard.DTYPE_INT32, np.arange(6, dtype=np.int32).reshape(2, 3))
    body = tensor.SerializeToString()
    packed_shape = b"\x12\x02\x02\x03"
    assert packed_shape in body
    canonical = bundle_of(body)
    expected = outcome(through_protobuf, canonical)
    assert expected != ("refused", shard.ERROR_CODE_PAYLOAD_CORRUPT)
    checksum = shard.NamedTensor(checksum=tensor.checksum).SerializeToString()
    variants = {
        "unknown bundle field": canonical + unknown_field(9),
        "unknown tensor field": bundle_of(body + unknown_field(12)),
        "bundle version twice": canonical + b"\x08\x01",
        # A repeated submessage merges into the first: protobuf's rule, left to protobuf.
        "checksum twice": bundle_of(body + checksum),
        "unpacked shape": bundle_of(body.replace(packed_shape, b"\x10\x02\x10\x03")),
        "shape in two packed runs": bundle_of(body.replace(packed_shape, b"\x12\x01\x02\x12\x01\x03")),
    }
    for name, wire in variants.items():
        assert read_bundle(wire, DEFAULT_LIMITS) is None, name
        assert outcome(decode_bundle_bytes, wire) == expected, name


def test_a_name_that_is_not_utf8_is_refused_as_protobuf_refuses_it() -> None:
    wire = encode_bundle(
        [encode_tensor("tt", shard.DTYPE_INT32, np.arange(2, dtype=np.int32))]
    ).SerializeToString()
    broken = wire.replace(b"\x0a\x02tt", b"\x0a\x02\xff\xfe")
    assert read_bundle(broken, DEFAULT_LIMITS) is None
    assert outcome(decode_bundle_bytes, broken) == ("refused", shard.ERROR_CODE_PAYLOAD_CORRUPT)


def measured_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    "tensor_body",
    [
        pytest.param(b"\x0a\x01t\x12" + varint(1 << 20) + b"\x01" * (1 << 20), id="a million dimensions"),
        pytest.param(b"\x42\x00" * 200_000, id="200 000 fragments"),
    ],
)
def test_counts_over_budget_are_refused_before_the_lists_grow(tensor_body: bytes) -> None:
    wire = bundle_of(tensor_body)
    assert outcome(decode_bundle_bytes, wire) == ("refused", shard.ERROR_CODE_PAYLOAD_CORRUPT)

    def attempt() -> None:
        with pytest.raises(PayloadCorrupt):
            read_bundle(wire, DEFAULT_LIMITS)

    # What the budget allows (8 dimensions, 4096 fragment records: ~0.3 MB), far below what
    # a million Python ints or 200 000 fragment records would take (tens of MB).
    assert measured_peak(attempt) < 1024 * 1024


def test_tensors_over_budget_are_refused() -> None:
    tensors = [encode_tensor(f"t{i}", shard.DTYPE_INT32, np.arange(1, dtype=np.int32)) for i in range(9)]
    wire = encode_bundle(tensors).SerializeToString()
    with pytest.raises(PayloadCorrupt, match="more than 8 tensors"):
        read_bundle(wire, DEFAULT_LIMITS)
    assert outcome(decode_bundle_bytes, wire) == ("refused", shard.ERROR_CODE_PAYLOAD_CORRUPT)


def chunk_message(kind: type, **fields) -> bytes:
    tensor = encode_tensor("hidden_states", shard.DTYPE_FLOAT32, np.ones((2, 4), dtype=np.float32))
    chunk = shard.ActivationChunk(
        envelope=shard.Envelope(work_id="w1", route_session_id="s1"), bundle=encode_bundle([tensor])
    )
    return kind(chunk=chunk, **fields).SerializeToString()


@pytest.mark.parametrize("kind", [shard.SessionRequest, shard.SessionResponse])
def test_an_activation_chunk_splits_into_its_envelope_and_bundle(kind: type) -> None:
    body = chunk_message(kind)
    envelope, bundle = read_activation_chunk(body, DEFAULT_LIMITS)
    assert shard.Envelope.FromString(envelope).work_id == "w1"
    assert [t.name for t in bundle.tensors] == ["hidden_states"]
    assert np.shares_memory(
        np.frombuffer(bundle.tensors[0].fragments[0].payload, np.uint8), np.frombuffer(body, np.uint8)
    )


def test_other_messages_are_left_to_protobuf() -> None:
    decode = shard.SessionRequest(decode=shard.DecodeStep(work_id="w")).SerializeToString()
    no_envelope = shard.SessionRequest(
        chunk=shard.ActivationChunk(bundle=shard.TensorBundle(bundle_version=1))
    ).SerializeToString()
    trailing = chunk_message(shard.SessionRequest) + unknown_field(9)
    over_budget = shard.SessionRequest(
        chunk=shard.ActivationChunk(
            envelope=shard.Envelope(work_id="w"),
            bundle=encode_bundle(
                encode_tensor(f"t{i}", shard.DTYPE_INT32, np.arange(1, dtype=np.int32)) for i in range(9)
            ),
        )
    ).SerializeToString()
    for body in (b"", decode, no_envelope, trailing, over_budget, b"\x12\x05\x0a"):
        assert read_activation_chunk(body, DEFAULT_LIMITS) is None
