"""The canonical GGUF layout of a verified manifest: header bytes and where each tensor goes.

A node that fetches a model has no file to copy a layout from, only the manifest and
the metadata blob (every key/value record's encoded bytes, in file order). Counting the
records and finding ``general.alignment`` needs a walk over the blob's records; the
header is then the magic, the manifest's GGUF version, the counts, the blob, and one
tensor info per manifest entry with offsets laid out back to back at the alignment,
which is how gguf-py and :func:`engines.gguf_file.write_gguf` lay out a file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf import GGUFValueType

from engines.gguf_file import DEFAULT_ALIGNMENT, GGUF_MAGIC
from engines.model_manifest import ModelManifest

_ALIGNMENT_KEY = b"general.alignment"
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


class MetadataFormatError(ValueError):
    """The metadata blob is not a sequence of GGUF key/value records."""


@dataclass(frozen=True)
class MetadataSummary:
    records: int
    alignment: int


def summarize_metadata(blob: bytes) -> MetadataSummary:
    """Count the records in ``blob`` and read its alignment; every byte must belong to a record."""
    view = memoryview(blob)
    pos, end, records = 0, len(view), 0
    alignment = DEFAULT_ALIGNMENT

    def take(size: int) -> memoryview:
        nonlocal pos
        if size < 0 or pos + size > end:
            raise MetadataFormatError(f"metadata record truncated at byte {pos}")
        part = view[pos : pos + size]
        pos += size
        return part

    def u32() -> int:
        return int.from_bytes(take(4), "little")

    def u64() -> int:
        return int.from_bytes(take(8), "little")

    def value_type(code: int) -> GGUFValueType:
        try:
            return GGUFValueType(code)
        except ValueError:
            raise MetadataFormatError(f"unknown metadata value type {code}") from None

    while pos < end:
        key = bytes(take(u64()))
        kind = value_type(u32())
        if kind == GGUFValueType.STRING:
            take(u64())
        elif kind == GGUFValueType.ARRAY:
            element = value_type(u32())
            count = u64()
            if element == GGUFValueType.STRING:
                for _ in range(count):
                    take(u64())
            elif element == GGUFValueType.ARRAY:
                raise MetadataFormatError("nested metadata arrays are not supported")
            else:
                take(count * _SCALAR_SIZES[element])
        else:
            raw = take(_SCALAR_SIZES[kind])
            if key == _ALIGNMENT_KEY and kind == GGUFValueType.UINT32:
                alignment = int.from_bytes(raw, "little")
        records += 1
    if alignment <= 0 or alignment & (alignment - 1):
        raise MetadataFormatError(f"invalid alignment {alignment}")
    return MetadataSummary(records, alignment)


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class GGUFLayout:
    header: bytes
    # Absolute file offset of the data section, and of each tensor (manifest order).
    data_offset: int
    tensor_offsets: tuple[int, ...]
    file_size: int


def canonical_layout(manifest: ModelManifest, metadata_blob: bytes) -> GGUFLayout:
    summary = summarize_metadata(metadata_blob)
    parts = [GGUF_MAGIC, struct.pack("<IQQ", manifest.gguf_version, len(manifest.tensors), summary.records)]
    parts.append(metadata_blob)
    relative, offset = [], 0
    for tensor in manifest.tensors:
        name = tensor.name.encode()
        parts.append(struct.pack("<Q", len(name)) + name)
        parts.append(struct.pack(f"<I{len(tensor.shape)}Q", len(tensor.shape), *tensor.shape))
        parts.append(struct.pack("<IQ", tensor.ggml_type, offset))
        relative.append(offset)
        offset = _align(offset + tensor.nbytes, summary.alignment)
    header = b"".join(parts)
    data_offset = _align(len(header), summary.alignment)
    return GGUFLayout(
        header=header,
        data_offset=data_offset,
        tensor_offsets=tuple(data_offset + r for r in relative),
        file_size=data_offset + offset,
    )


__all__ = ["GGUFLayout", "MetadataFormatError", "MetadataSummary", "canonical_layout", "summarize_metadata"]
