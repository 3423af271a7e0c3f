"""Tensor bundle codec: ``NamedTensor``/``TensorBundle`` encode and fail-closed decode.

Rules (from the schema's comments and the seed codec's behaviour):

- The checksum is CRC32C over the *uncompressed* canonical little-endian bytes,
  stored big-endian in ``Checksum.value``, so it survives a hop that compresses
  differently.
- Fragments carry the *wire* body (compressed iff the tensor says so). A decoder
  proves they tile it exactly by ``byte_offset`` (no hole, no overlap), in any
  arrival order, then decompresses once.
- zstd output is bounded: the frame must declare its content size, that size
  must equal ``total_bytes`` (itself within budget), the window is bounded, and
  trailing bytes after the frame are refused.
- Unspecified enums, big-endian payloads, bad shapes and counts over budget are
  refused as :class:`PayloadCorrupt`.

Arrays are handled in their wire representation: bfloat16 travels as ``uint16``
bit patterns; :func:`float32_to_bfloat16_bits` converts with round-to-nearest-even.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from meshnode.wire.bundle_reader import read_bundle
from meshnode.wire.crc32c import Buffer, crc32c
from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard
from meshnode.wire.tensor_parts import (
    DEFAULT_LIMITS,
    BundleParts,
    DecodeLimits,
    TensorParts,
    bundle_parts_from_pb,
    tensor_parts_from_pb,
)

BUNDLE_VERSION = 1
# Fragments are bounded by the negotiated max_chunk_bytes (a chunk message must
# fit one frame); by default a tensor that fits a frame is a single fragment,
# which a receiver verifies and reads in place without assembling a copy.
DEFAULT_FRAGMENT_BYTES = 8 * 1024 * 1024
ZSTD_LEVEL = 1

# Wire dtype -> numpy dtype of its little-endian representation.
NUMPY_DTYPES: dict[int, np.dtype] = {
    shard.DTYPE_BFLOAT16: np.dtype("<u2"),
    shard.DTYPE_FLOAT16: np.dtype("<f2"),
    shard.DTYPE_FLOAT32: np.dtype("<f4"),
    shard.DTYPE_INT32: np.dtype("<i4"),
    shard.DTYPE_INT64: np.dtype("<i8"),
    shard.DTYPE_UINT8: np.dtype("u1"),
    shard.DTYPE_INT8: np.dtype("i1"),
    shard.DTYPE_BOOL: np.dtype("?"),
}


@dataclass(frozen=True)
class WireTensor:
    """A decoded tensor in its wire representation (bfloat16 as uint16 bits)."""

    name: str
    dtype: int
    array: np.ndarray

    def as_float32(self) -> np.ndarray:
        if self.dtype == shard.DTYPE_BFLOAT16:
            return bfloat16_bits_to_float32(self.array)
        return self.array.astype(np.float32, copy=False)


# ---------------------------------------------------------------------------
# bfloat16
# ---------------------------------------------------------------------------


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    rounded = ((bits + rounding) >> np.uint32(16)).astype("<u2")
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        # Rounding could carry a NaN's payload into the exponent; keep it a quiet NaN.
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact widening of bfloat16 bit patterns to float32."""
    return (np.ascontiguousarray(bits, dtype="<u2").astype("<u4") << np.uint32(16)).view("<f4")


# ---------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------


def crc32c_checksum(data: Buffer) -> shard.Checksum:
    value = crc32c(data)
    return shard.Checksum(algorithm=shard.CHECKSUM_ALGORITHM_CRC32C, value=value.to_bytes(4, "big"))


def encode_tensor(
    name: str,
    dtype: shard.DType,
    array: np.ndarray,
    *,
    compression: shard.Compression = shard.COMPRESSION_NONE,
    max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
) -> shard.NamedTensor:
    """Encode ``array`` (already in ``dtype``'s wire representation)."""
    expected = NUMPY_DTYPES.get(dtype)
    if expected is None:
        raise ValueError(f"cannot encode dtype {dtype}")
    if array.dtype.kind != expected.kind or array.dtype.itemsize != expected.itemsize:
        raise ValueError(f"array dtype {array.dtype} does not match wire dtype {shard.DType.Name(dtype)}")
    if max_fragment_bytes <= 0:
        raise ValueError("max_fragment_bytes must be positive")
    raw = np.ascontiguousarray(array, dtype=expected).tobytes()
    if compression == shard.COMPRESSION_ZSTD:
        wire = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw)
    elif compression == shard.COMPRESSION_NONE:
        wire = raw
    else:
        raise ValueError(f"cannot encode compression {compression}")
    tensor = shard.NamedTensor(
        name=name,
        shape=list(array.shape),
        dtype=dtype,
        byte_order=shard.BYTE_ORDER_LITTLE_ENDIAN,
        total_bytes=len(raw),
        compression=compression,
        checksum=crc32c_checksum(raw),
    )
    count = max(1, -(-len(wire) // max_fragment_bytes))
    if count == 1:
        tensor.fragments.add(fragment_index=0, fragment_count=1, byte_offset=0, payload=wire)
    else:
        view = memoryview(wire)
        for index in range(count):
            offset = index * max_fragment_bytes
            tensor.fragments.add(
                fragment_index=index,
                fragment_count=count,
                byte_offset=offset,
                payload=view[offset : offset + max_fragment_bytes].tobytes(),
            )
    return tensor


def encode_float_tensor(
    name: str,
    values: np.ndarray,
    dtype: shard.DType,
    *,
    compression: shard.Compression = shard.COMPRESSION_NONE,
    max_fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
) -> shard.NamedTensor:
    """Encode float32 activations at a route's boundary dtype (float32, bfloat16 or float16)."""
    if dtype == shard.DTYPE_BFLOAT16:
        wire = float32_to_bfloat16_bits(values)
    elif dtype in (shard.DTYPE_FLOAT32, shard.DTYPE_FLOAT16):
        wire = np.asarray(values, dtype=NUMPY_DTYPES[dtype])
    else:
        raise ValueError(f"{shard.DType.Name(dtype)} is not a float boundary dtype")
    return encode_tensor(name, dtype, wire, compression=compression, max_fragment_bytes=max_fragment_bytes)


def encode_bundle(tensors: Iterable[shard.NamedTensor]) -> shard.TensorBundle:
    return shard.TensorBundle(bundle_version=BUNDLE_VERSION, tensors=list(tensors))


# ---------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------


def _check_rank(parts: TensorParts, limits: DecodeLimits) -> None:
    if len(parts.shape) > limits.max_rank:
        raise PayloadCorrupt(f"tensor {parts.name!r}: rank {len(parts.shape)} over {limits.max_rank}")


def _as_signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _enum_name(name_of: Callable[[int], str], value: int) -> str:
    """``name_of(value)`` (a generated enum's ``Name``), or the number for a value it lacks."""
    try:
        return name_of(_as_signed32(value))
    except ValueError:
        return str(_as_signed32(value))


def _check_header(parts: TensorParts, limits: DecodeLimits) -> np.dtype:
    if not parts.name or len(parts.name) > limits.max_name_length:
        raise PayloadCorrupt("tensor name is empty or too long")
    name = parts.name
    np_dtype = NUMPY_DTYPES.get(parts.dtype)
    if np_dtype is None:
        raise PayloadCorrupt(f"tensor {name!r}: dtype {_enum_name(shard.DType.Name, parts.dtype)} refused")
    if parts.byte_order != shard.BYTE_ORDER_LITTLE_ENDIAN:
        raise PayloadCorrupt(
            f"tensor {name!r}: byte order {_enum_name(shard.ByteOrder.Name, parts.byte_order)} refused"
        )
    if parts.compression not in (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD):
        raise PayloadCorrupt(
            f"tensor {name!r}: compression {_enum_name(shard.Compression.Name, parts.compression)} refused"
        )
    _check_rank(parts, limits)
    elements = 1
    for dim in parts.shape:
        if dim < 0:
            raise PayloadCorrupt(f"tensor {name!r}: negative dimension")
        elements *= dim
    if elements * np_dtype.itemsize != parts.total_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: shape does not match total_bytes")
    if parts.total_bytes > limits.max_tensor_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: {parts.total_bytes} bytes over budget")
    if parts.checksum_algorithm == shard.CHECKSUM_ALGORITHM_CRC32C:
        if len(parts.checksum_value) != 4:
            raise PayloadCorrupt(f"tensor {name!r}: CRC32C value must be 4 bytes")
    elif parts.checksum_algorithm != shard.CHECKSUM_ALGORITHM_NONE or limits.require_checksum:
        raise PayloadCorrupt(
            f"tensor {name!r}: checksum {_enum_name(shard.ChecksumAlgorithm.Name, parts.checksum_algorithm)} refused"
        )
    return np_dtype


def _wire_body_limit(parts: TensorParts) -> int:
    if parts.compression == shard.COMPRESSION_NONE:
        return parts.total_bytes
    # ZSTD_COMPRESSBOUND: the largest frame zstd can emit for this input.
    size = parts.total_bytes
    margin = ((128 * 1024 - size) >> 11) if size < 128 * 1024 else 0
    return size + (size >> 8) + margin + 64


def _assemble_wire_body(parts: TensorParts, limits: DecodeLimits) -> Buffer:
    """Prove the fragments tile the wire body exactly and return it.

    A single fragment is returned as is (no copy); several are copied once into
    one buffer in offset order, whatever order they arrived in.
    """
    name, fragments = parts.name, parts.fragments
    count = len(fragments)
    if count == 0 or count > limits.max_fragments:
        raise PayloadCorrupt(f"tensor {name!r}: {count} fragments")
    limit = _wire_body_limit(parts)
    if count == 1:
        only = fragments[0]
        if only.index != 0 or only.count != 1 or only.offset != 0:
            raise PayloadCorrupt(f"tensor {name!r}: fragment does not start the body")
        body: Buffer = only.payload
    else:
        ordered = sorted(fragments, key=lambda f: f.offset)
        expected_offset = 0
        for position, fragment in enumerate(ordered):
            if fragment.count != count or fragment.index != position:
                raise PayloadCorrupt(f"tensor {name!r}: fragment indices do not match offsets")
            if fragment.offset != expected_offset:
                kind = "hole" if fragment.offset > expected_offset else "overlap"
                raise PayloadCorrupt(f"tensor {name!r}: fragments leave a {kind}")
            expected_offset += len(fragment.payload)
            if expected_offset > limit:
                raise PayloadCorrupt(f"tensor {name!r}: fragments exceed the body size")
        # Sized from the proven extent, which is within the budget checked above;
        # every byte is overwritten, so skip zero-filling it.
        assembled = np.empty(expected_offset, dtype=np.uint8)
        for fragment in ordered:
            size = len(fragment.payload)
            assembled[fragment.offset : fragment.offset + size] = np.frombuffer(fragment.payload, np.uint8)
        body = assembled.data
    if parts.compression == shard.COMPRESSION_NONE and len(body) != parts.total_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: fragments do not cover total_bytes")
    if len(body) > limit:
        raise PayloadCorrupt(f"tensor {name!r}: compressed body larger than possible")
    return body


def _decompress(parts: TensorParts, body: Buffer, limits: DecodeLimits) -> bytes:
    name = parts.name
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError:
        raise PayloadCorrupt(f"tensor {name!r}: not a zstd frame") from None
    if declared != parts.total_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: zstd frame does not declare total_bytes")
    decompressor = zstandard.ZstdDecompressor(max_window_size=limits.max_zstd_window).decompressobj()
    try:
        # The declared size is enforced by zstd itself: a frame that expands past
        # it fails instead of growing the output.
        raw = decompressor.decompress(body)
    except zstandard.ZstdError:
        raise PayloadCorrupt(f"tensor {name!r}: zstd frame is corrupt or over the window") from None
    if not decompressor.eof or decompressor.unused_data or len(raw) != parts.total_bytes:
        raise PayloadCorrupt(f"tensor {name!r}: zstd frame has the wrong extent")
    return raw


def _decode_parts(parts: TensorParts, limits: DecodeLimits) -> WireTensor:
    np_dtype = _check_header(parts, limits)
    body = _assemble_wire_body(parts, limits)
    raw = _decompress(parts, body, limits) if parts.compression == shard.COMPRESSION_ZSTD else body
    if parts.checksum_algorithm == shard.CHECKSUM_ALGORITHM_CRC32C and crc32c(raw) != int.from_bytes(
        parts.checksum_value, "big"
    ):
        raise PayloadCorrupt(f"tensor {parts.name!r}: checksum mismatch")
    array = np.frombuffer(raw, dtype=np_dtype)
    if parts.dtype == shard.DTYPE_BOOL and array.size and np.any(array.view(np.uint8) > 1):
        raise PayloadCorrupt(f"tensor {parts.name!r}: bool payload holds values other than 0 and 1")
    return WireTensor(name=parts.name, dtype=parts.dtype, array=array.reshape(tuple(parts.shape)))


def decode_tensor(tensor: shard.NamedTensor, limits: DecodeLimits = DEFAULT_LIMITS) -> WireTensor:
    return _decode_parts(tensor_parts_from_pb(tensor), limits)


def _check_bundle_budget(version: int, sizes: list[int], limits: DecodeLimits) -> None:
    if version != BUNDLE_VERSION:
        raise PayloadCorrupt(f"bundle version {version} refused")
    if len(sizes) > limits.max_tensors:
        raise PayloadCorrupt(f"bundle holds {len(sizes)} tensors, over {limits.max_tensors}")
    if sum(sizes) > limits.max_bundle_bytes:
        raise PayloadCorrupt(f"bundle of {sum(sizes)} bytes over budget")


def _collect(tensors: Iterable[WireTensor]) -> dict[str, WireTensor]:
    decoded: dict[str, WireTensor] = {}
    for tensor in tensors:
        if tensor.name in decoded:
            raise PayloadCorrupt(f"bundle names tensor {tensor.name!r} twice")
        decoded[tensor.name] = tensor
    return decoded


def decode_bundle_parts(bundle: BundleParts, limits: DecodeLimits = DEFAULT_LIMITS) -> dict[str, WireTensor]:
    tensors = bundle.tensors
    _check_bundle_budget(bundle.version, [t.total_bytes for t in tensors], limits)
    return _collect(_decode_parts(t, limits) for t in tensors)


def decode_bundle(bundle: shard.TensorBundle, limits: DecodeLimits = DEFAULT_LIMITS) -> dict[str, WireTensor]:
    return decode_bundle_parts(bundle_parts_from_pb(bundle), limits)


def decode_bundle_bytes(data: Buffer, limits: DecodeLimits = DEFAULT_LIMITS) -> dict[str, WireTensor]:
    """Decode a serialized ``TensorBundle`` straight from the received bytes.

    The returned arrays view ``data`` wherever a tensor arrived as one uncompressed
    fragment, so ``data`` must not change afterwards (frames arrive as ``bytes``).
    """
    parts = read_bundle(data, limits)
    if parts is None:
        bundle = shard.TensorBundle()
        try:
            bundle.ParseFromString(data)
        except DecodeError:
            raise PayloadCorrupt("bundle is not a well-formed TensorBundle") from None
        parts = bundle_parts_from_pb(bundle)
    return decode_bundle_parts(parts, limits)


__all__ = [
    "BUNDLE_VERSION",
    "DEFAULT_LIMITS",
    "NUMPY_DTYPES",
    "DecodeLimits",
    "WireTensor",
    "bfloat16_bits_to_float32",
    "crc32c_checksum",
    "decode_bundle",
    "decode_bundle_bytes",
    "decode_bundle_parts",
    "decode_tensor",
    "encode_bundle",
    "encode_float_tensor",
    "encode_tensor",
    "float32_to_bfloat16_bits",
]
