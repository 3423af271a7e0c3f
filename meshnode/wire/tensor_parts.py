"""The fields of a ``TensorBundle`` as plain Python values, however they were parsed,
and the budgets a receiver holds them to.

The codec checks and decodes these, not protobuf objects, so a bundle parsed by
the protobuf runtime and one read in place by :mod:`meshnode.wire.bundle_reader`
go through exactly the same validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode.wire.crc32c import Buffer
from meshnode.wire.pb import shard


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


@dataclass(slots=True)
class FragmentParts:
    index: int = 0
    count: int = 0
    offset: int = 0
    payload: Buffer = b""


@dataclass(slots=True)
class TensorParts:
    """The fields of one ``NamedTensor``, read once (each access to a protobuf field costs)."""

    name: str = ""
    shape: list[int] = field(default_factory=list)
    dtype: int = 0
    byte_order: int = 0
    total_bytes: int = 0
    compression: int = 0
    checksum_algorithm: int = 0
    checksum_value: bytes = b""
    fragments: list[FragmentParts] = field(default_factory=list)


@dataclass(slots=True)
class BundleParts:
    version: int = 0
    tensors: list[TensorParts] = field(default_factory=list)


def tensor_parts_from_pb(tensor: shard.NamedTensor) -> TensorParts:
    # Positional and each submessage read once: this runs per decode step.
    checksum = tensor.checksum
    return TensorParts(
        tensor.name,
        list(tensor.shape),
        tensor.dtype,
        tensor.byte_order,
        tensor.total_bytes,
        tensor.compression,
        checksum.algorithm,
        checksum.value,
        [
            FragmentParts(f.fragment_index, f.fragment_count, f.byte_offset, f.payload)
            for f in tensor.fragments
        ],
    )


def bundle_parts_from_pb(bundle: shard.TensorBundle) -> BundleParts:
    return BundleParts(bundle.bundle_version, [tensor_parts_from_pb(t) for t in bundle.tensors])


__all__ = [
    "DEFAULT_LIMITS",
    "Buffer",
    "BundleParts",
    "DecodeLimits",
    "FragmentParts",
    "TensorParts",
    "bundle_parts_from_pb",
    "tensor_parts_from_pb",
]
