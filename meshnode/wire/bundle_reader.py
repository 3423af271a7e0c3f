"""Read a serialized ``TensorBundle`` in place: payloads become views of the input.

The protobuf runtime copies every ``bytes`` field twice on the way in (into its
arena while parsing, into a new Python object when the field is read); at 1 MiB
those copies cost as much as verifying the checksum. This reader walks the wire
format of ``TensorBundle``, ``NamedTensor``, ``Checksum`` and ``TensorFragment``
and returns :class:`TensorParts` whose payloads are ``memoryview`` slices of the
received bytes, so decoding a tensor that fits one fragment copies nothing.

It reads only the encoding a proto3 encoder emits for these messages: one-byte
tags, each field with its declared wire type, singular fields at most once, the
shape packed, varints within their field's range. Anything else (an unknown or
repeated singular field, an unpacked shape, a negative value, truncation, a name
that is not UTF-8) makes it return ``None``, and the caller parses with protobuf
instead, so what it accepts decodes exactly as the runtime would decode it (the
tests compare the two on generated and mutated bundles). Counts over the
receiver's budget (tensors, rank, fragments) are refused here as
:class:`PayloadCorrupt` before any list grows past them.
"""

from __future__ import annotations

from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.tensor_parts import Buffer, BundleParts, DecodeLimits, FragmentParts, TensorParts

_UINT32_END = 1 << 32
_ENUM_END = 1 << 31  # larger varints are negative int32 values on the wire
_INT64_END = 1 << 63  # larger varints are negative int64 values
_UINT64_END = 1 << 64
_MAX_VARINT_BYTES = 10

# Tags: (field number << 3) | wire type (0 = varint, 2 = length-delimited).
_BUNDLE_VERSION, _BUNDLE_TENSOR = 0x08, 0x12
_NAME, _SHAPE, _DTYPE, _BYTE_ORDER, _TOTAL_BYTES, _COMPRESSION, _CHECKSUM, _FRAGMENT = (
    0x0A,
    0x12,
    0x18,
    0x20,
    0x28,
    0x30,
    0x3A,
    0x42,
)
_ALGORITHM, _VALUE = 0x08, 0x12
_INDEX, _COUNT, _OFFSET, _PAYLOAD = 0x08, 0x10, 0x18, 0x22
_ACTIVATION_CHUNK = 0x12  # field 2 of both SessionRequest and SessionResponse
_ENVELOPE, _CHUNK_BUNDLE = 0x0A, 0x12


class _Unsupported(Exception):
    """The bytes use an encoding this reader leaves to the protobuf runtime."""


def _varint(data: Buffer, i: int, end: int, limit: int) -> tuple[int, int]:
    """The varint at ``i`` (below ``limit``) and the index after it."""
    byte = data[i] if i < end else 0x80
    if byte < 0x80:  # most values here fit one byte
        return byte, i + 1
    value = 0
    shift = 0
    stop = end if end < i + _MAX_VARINT_BYTES else i + _MAX_VARINT_BYTES
    while i < stop:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= limit:
                raise _Unsupported
            return value, i
        shift += 7
    raise _Unsupported


def _span(data: Buffer, i: int, end: int) -> tuple[int, int]:
    """Start and end of the length-delimited value whose length starts at ``i``."""
    length, i = _varint(data, i, end, _UINT64_END)
    stop = i + length
    if stop > end:
        raise _Unsupported
    return i, stop


def _checksum(data: Buffer, view: memoryview, i: int, end: int, parts: TensorParts) -> None:
    seen = 0
    while i < end:
        tag = data[i]
        i += 1
        if tag == _ALGORITHM and not seen & 1:
            seen |= 1
            parts.checksum_algorithm, i = _varint(data, i, end, _ENUM_END)
        elif tag == _VALUE and not seen & 2:
            seen |= 2
            start, i = _span(data, i, end)
            parts.checksum_value = bytes(view[start:i])
        else:
            raise _Unsupported


def _fragment(data: Buffer, view: memoryview, i: int, end: int) -> FragmentParts:
    fragment = FragmentParts()
    seen = 0
    while i < end:
        tag = data[i]
        i += 1
        bit = 1 << (tag >> 3)
        if seen & bit:
            raise _Unsupported
        seen |= bit
        if tag == _PAYLOAD:
            start, i = _span(data, i, end)
            fragment.payload = view[start:i]
        elif tag == _OFFSET:
            fragment.offset, i = _varint(data, i, end, _UINT64_END)
        elif tag == _INDEX:
            fragment.index, i = _varint(data, i, end, _UINT32_END)
        elif tag == _COUNT:
            fragment.count, i = _varint(data, i, end, _UINT32_END)
        else:
            raise _Unsupported
    return fragment


def _shape(data: Buffer, i: int, end: int, limits: DecodeLimits) -> list[int]:
    shape: list[int] = []
    while i < end:
        if len(shape) == limits.max_rank:
            raise PayloadCorrupt(f"tensor shape has more than {limits.max_rank} dimensions")
        dim, i = _varint(data, i, end, _INT64_END)
        shape.append(dim)
    return shape


def _tensor(data: Buffer, view: memoryview, i: int, end: int, limits: DecodeLimits) -> TensorParts:
    parts = TensorParts()
    fragments = parts.fragments
    seen = 0
    while i < end:
        tag = data[i]
        i += 1
        if tag == _FRAGMENT:
            if len(fragments) == limits.max_fragments:
                raise PayloadCorrupt(f"tensor has more than {limits.max_fragments} fragments")
            start, i = _span(data, i, end)
            fragments.append(_fragment(data, view, start, i))
            continue
        bit = 1 << (tag >> 3)
        if seen & bit:
            raise _Unsupported
        seen |= bit
        if tag == _NAME:
            start, i = _span(data, i, end)
            try:
                parts.name = str(view[start:i], "utf-8")
            except UnicodeDecodeError:
                raise _Unsupported from None
        elif tag == _SHAPE:
            start, i = _span(data, i, end)
            parts.shape = _shape(data, start, i, limits)
        elif tag == _DTYPE:
            parts.dtype, i = _varint(data, i, end, _ENUM_END)
        elif tag == _BYTE_ORDER:
            parts.byte_order, i = _varint(data, i, end, _ENUM_END)
        elif tag == _TOTAL_BYTES:
            parts.total_bytes, i = _varint(data, i, end, _UINT64_END)
        elif tag == _COMPRESSION:
            parts.compression, i = _varint(data, i, end, _ENUM_END)
        elif tag == _CHECKSUM:
            start, i = _span(data, i, end)
            _checksum(data, view, start, i, parts)
        else:
            raise _Unsupported
    return parts


def _bundle(data: Buffer, view: memoryview, i: int, end: int, limits: DecodeLimits) -> BundleParts:
    bundle = BundleParts()
    tensors = bundle.tensors
    version_seen = False
    while i < end:
        tag = data[i]
        i += 1
        if tag == _BUNDLE_TENSOR:
            if len(tensors) == limits.max_tensors:
                raise PayloadCorrupt(f"bundle holds more than {limits.max_tensors} tensors")
            start, i = _span(data, i, end)
            tensors.append(_tensor(data, view, start, i, limits))
        elif tag == _BUNDLE_VERSION and not version_seen:
            version_seen = True
            bundle.version, i = _varint(data, i, end, _UINT32_END)
        else:
            raise _Unsupported
    return bundle


def _as_indexable(data: Buffer) -> tuple[Buffer, memoryview]:
    # Indexing bytes is the fastest way to read one byte; other buffers are read as unsigned bytes.
    if type(data) is bytes:
        return data, memoryview(data)
    view = memoryview(data).cast("B")
    return view, view


def read_bundle(data: Buffer, limits: DecodeLimits) -> BundleParts | None:
    """The parts of the serialized ``TensorBundle`` in ``data``, payloads viewing ``data``;
    ``None`` when ``data`` must be parsed by protobuf instead.

    The views alias ``data``: pass an immutable buffer (the frame decoder yields ``bytes``).
    """
    indexable, view = _as_indexable(data)
    try:
        return _bundle(indexable, view, 0, len(view), limits)
    except _Unsupported:
        return None


def read_activation_chunk(data: Buffer, limits: DecodeLimits) -> tuple[memoryview, BundleParts] | None:
    """Split a serialized SessionRequest or SessionResponse that carries an ActivationChunk
    (field 2 of both) into the chunk's serialized ``Envelope`` and its bundle's parts.

    ``None`` unless the message is exactly one ActivationChunk holding one non-empty envelope
    and one bundle within the counts of ``limits``; the caller then parses the whole message
    with protobuf, and the codec refuses what is over budget when the chunk is decoded, as the
    answer to that one unit.
    """
    if not data or data[0] != _ACTIVATION_CHUNK:
        return None  # every other request kind: checked per frame, so before any view is made
    indexable, view = _as_indexable(data)
    end = len(view)
    try:
        i, stop = _span(indexable, 1, end)
        if stop != end:
            return None
        envelope: tuple[int, int] | None = None
        bundle: BundleParts | None = None
        while i < end:
            tag = indexable[i]
            i += 1
            start, i = _span(indexable, i, end)
            if tag == _ENVELOPE and envelope is None and i > start:
                envelope = (start, i)
            elif tag == _CHUNK_BUNDLE and bundle is None:
                bundle = _bundle(indexable, view, start, i, limits)
            else:
                return None
    except (_Unsupported, PayloadCorrupt):
        return None
    if envelope is None or bundle is None:
        return None
    return view[envelope[0] : envelope[1]], bundle


__all__ = ["read_activation_chunk", "read_bundle"]
