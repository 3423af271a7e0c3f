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

from collections.abc import Iterable
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zstandard

from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard

BUNDLE_VERSION = 1
DEFAULT_FRAGMENT_BYTES = 1024 * 1024
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
class DecodeLimits:
    """Budgets a receiver enforces before it allocates anything."""

    max_tensors: int = 8
    max_rank: int = 8
    max_tensor_bytes: int = 64 * 1024 * 1024
    max_bundle_bytes: int = 64 * 1024 * 1024
    max_fragments: int = 4096
    max_name_length: int = 128
    max_zstd_window: int = 1 << 24
    require_checksum: bool = True


DEFAULT_LIMITS = DecodeLimits()


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


def crc32c_checksum(data: bytes) -> shard.Checksum:
    value = google_crc32c.value(data)
    return shard.Checksum(algorithm=shard.CHECKSUM_ALGORITHM_CRC32C, value=value.to_bytes(4, "big"))


def encode_tensor(
    name: str,
    dtype: int,
    array: np.ndarray,
    *,
    compression: int = shard.COMPRESSION_NONE,
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
        dtype=dtype,  # type: ignore[arg-type]
        byte_order=shard.BYTE_ORDER_LITTLE_ENDIAN,
        total_bytes=len(raw),
        compression=compression,  # type: ignore[arg-type]
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
    dtype: int,
    *,
    compression: int = shard.COMPRESSION_NONE,
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


def _enum_name(enum: object, value: int) -> str:
    try:
        return enum.Name(value)  # type: ignore[attr-defined]
    except ValueError:
        return str(value)


def _check_header(tensor: shard.NamedTensor, limits: DecodeLimits) -> np.dtype:
    if not tensor.name or len(tensor.name) > limits.max_name_length:
        raise PayloadCorrupt("tensor name is empty or too long")
    np_dtype = NUMPY_DTYPES.get(tensor.dtype)
    if np_dtype is None:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: dtype {_enum_name(shard.DType, tensor.dtype)} refused")
    if tensor.byte_order != shard.BYTE_ORDER_LITTLE_ENDIAN:
        raise PayloadCorrupt(
            f"tensor {tensor.name!r}: byte order {_enum_name(shard.ByteOrder, tensor.byte_order)} refused"
        )
    if tensor.compression not in (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD):
        raise PayloadCorrupt(
            f"tensor {tensor.name!r}: compression {_enum_name(shard.Compression, tensor.compression)} refused"
        )
    if len(tensor.shape) > limits.max_rank:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: rank {len(tensor.shape)} over {limits.max_rank}")
    elements = 1
    for dim in tensor.shape:
        if dim < 0:
            raise PayloadCorrupt(f"tensor {tensor.name!r}: negative dimension")
        elements *= dim
    if elements * np_dtype.itemsize != tensor.total_bytes:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: shape does not match total_bytes")
    if tensor.total_bytes > limits.max_tensor_bytes:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: {tensor.total_bytes} bytes over budget")
    checksum = tensor.checksum
    if checksum.algorithm == shard.CHECKSUM_ALGORITHM_CRC32C:
        if len(checksum.value) != 4:
            raise PayloadCorrupt(f"tensor {tensor.name!r}: CRC32C value must be 4 bytes")
    elif checksum.algorithm == shard.CHECKSUM_ALGORITHM_NONE and not limits.require_checksum:
        pass
    else:
        raise PayloadCorrupt(
            f"tensor {tensor.name!r}: checksum "
            f"{_enum_name(shard.ChecksumAlgorithm, checksum.algorithm)} refused"
        )
    return np_dtype


def _wire_body_limit(tensor: shard.NamedTensor) -> int:
    if tensor.compression == shard.COMPRESSION_NONE:
        return tensor.total_bytes
    # ZSTD_COMPRESSBOUND: the largest frame zstd can emit for this input.
    size = tensor.total_bytes
    margin = ((128 * 1024 - size) >> 11) if size < 128 * 1024 else 0
    return size + (size >> 8) + margin + 64


def _assemble_wire_body(tensor: shard.NamedTensor, limits: DecodeLimits) -> bytes:
    """Prove the fragments tile the wire body exactly and return it."""
    fragments = tensor.fragments
    count = len(fragments)
    if count == 0 or count > limits.max_fragments:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: {count} fragments")
    if count == 1:
        only = fragments[0]
        if only.fragment_index != 0 or only.fragment_count != 1 or only.byte_offset != 0:
            raise PayloadCorrupt(f"tensor {tensor.name!r}: fragment does not start the body")
        body = only.payload
    else:
        ordered = sorted(fragments, key=lambda f: f.byte_offset)
        limit = _wire_body_limit(tensor)
        expected_offset = 0
        for position, fragment in enumerate(ordered):
            if fragment.fragment_count != count or fragment.fragment_index != position:
                raise PayloadCorrupt(f"tensor {tensor.name!r}: fragment indices do not match offsets")
            if fragment.byte_offset != expected_offset:
                kind = "hole" if fragment.byte_offset > expected_offset else "overlap"
                raise PayloadCorrupt(f"tensor {tensor.name!r}: fragments leave a {kind}")
            expected_offset += len(fragment.payload)
            if expected_offset > limit:
                raise PayloadCorrupt(f"tensor {tensor.name!r}: fragments exceed the body size")
        body = b"".join(f.payload for f in ordered)
    if tensor.compression == shard.COMPRESSION_NONE and len(body) != tensor.total_bytes:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: fragments do not cover total_bytes")
    if len(body) > _wire_body_limit(tensor):
        raise PayloadCorrupt(f"tensor {tensor.name!r}: compressed body larger than possible")
    return body


def _decompress(tensor: shard.NamedTensor, body: bytes, limits: DecodeLimits) -> bytes:
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: not a zstd frame") from None
    if declared != tensor.total_bytes:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: zstd frame does not declare total_bytes")
    decompressor = zstandard.ZstdDecompressor(max_window_size=limits.max_zstd_window).decompressobj()
    try:
        # The declared size is enforced by zstd itself: a frame that expands past
        # it fails instead of growing the output.
        raw = decompressor.decompress(body)
    except zstandard.ZstdError:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: zstd frame is corrupt or over the window") from None
    if not decompressor.eof or decompressor.unused_data or len(raw) != tensor.total_bytes:
        raise PayloadCorrupt(f"tensor {tensor.name!r}: zstd frame has the wrong extent")
    return raw


def decode_tensor(tensor: shard.NamedTensor, limits: DecodeLimits = DEFAULT_LIMITS) -> WireTensor:
    np_dtype = _check_header(tensor, limits)
    body = _assemble_wire_body(tensor, limits)
    raw = _decompress(tensor, body, limits) if tensor.compression == shard.COMPRESSION_ZSTD else body
    checksum = tensor.checksum
    if checksum.algorithm == shard.CHECKSUM_ALGORITHM_CRC32C and google_crc32c.value(raw) != int.from_bytes(
        checksum.value, "big"
    ):
        raise PayloadCorrupt(f"tensor {tensor.name!r}: checksum mismatch")
    array = np.frombuffer(raw, dtype=np_dtype)
    if tensor.dtype == shard.DTYPE_BOOL and array.size and raw.translate(None, b"\x00\x01"):
        raise PayloadCorrupt(f"tensor {tensor.name!r}: bool payload holds values other than 0 and 1")
    return WireTensor(name=tensor.name, dtype=tensor.dtype, array=array.reshape(tuple(tensor.shape)))


def decode_bundle(bundle: shard.TensorBundle, limits: DecodeLimits = DEFAULT_LIMITS) -> dict[str, WireTensor]:
    if bundle.bundle_version != BUNDLE_VERSION:
        raise PayloadCorrupt(f"bundle version {bundle.bundle_version} refused")
    if len(bundle.tensors) > limits.max_tensors:
        raise PayloadCorrupt(f"bundle holds {len(bundle.tensors)} tensors, over {limits.max_tensors}")
    total = sum(t.total_bytes for t in bundle.tensors)
    if total > limits.max_bundle_bytes:
        raise PayloadCorrupt(f"bundle of {total} bytes over budget")
    decoded: dict[str, WireTensor] = {}
    for tensor in bundle.tensors:
        if tensor.name in decoded:
            raise PayloadCorrupt(f"bundle names tensor {tensor.name!r} twice")
        decoded[tensor.name] = decode_tensor(tensor, limits)
    return decoded


__all__ = [
    "BUNDLE_VERSION",
    "DEFAULT_LIMITS",
    "NUMPY_DTYPES",
    "DecodeLimits",
    "WireTensor",
    "bfloat16_bits_to_float32",
    "crc32c_checksum",
    "decode_bundle",
    "decode_tensor",
    "encode_bundle",
    "encode_float_tensor",
    "encode_tensor",
    "float32_to_bfloat16_bits",
]
