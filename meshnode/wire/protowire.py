"""A minimal protobuf wire-format reader that hands out zero-copy views.

The generated protobuf classes copy every ``bytes`` field twice on receipt
(once when parsing, once when the field is read). For tensor payloads, the only
large fields the node receives, that is most of the decode cost, so the tensor
codec reads those messages with this reader instead: length-delimited fields
come back as ``memoryview`` slices of the received frame.

Only what the codec needs: varint, 64-bit, length-delimited and 32-bit wire
types; groups are refused. Errors are :class:`WireFormatError`.
"""

from __future__ import annotations

from collections.abc import Iterator

from meshnode.wire.errors import MeshnodeError

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


class WireFormatError(MeshnodeError):
    """Bytes that are not a well-formed protobuf message."""


def read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, next position)."""
    result = 0
    shift = 0
    end = len(view)
    while True:
        if pos >= end:
            raise WireFormatError("truncated varint")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireFormatError("varint longer than 10 bytes")


def as_int64(value: int) -> int:
    """Reinterpret a decoded varint as a two's-complement int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def iter_fields(view: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """Yield ``(field_number, wire_type, value)``; value is an int or a view."""
    pos, end = 0, len(view)
    while pos < end:
        # Keys and most values are one-byte varints: decode those inline.
        key = view[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = read_varint(view, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireFormatError("field number 0")
        if wire_type in (VARINT, LENGTH_DELIMITED):
            if pos < end and view[pos] < 0x80:
                value = view[pos]
                pos += 1
            else:
                value, pos = read_varint(view, pos)
            if wire_type == VARINT:
                yield number, wire_type, value
                continue
            if value > end - pos:
                raise WireFormatError("length-delimited field runs past the message")
            yield number, wire_type, view[pos : pos + value]
            pos += value
        elif wire_type == FIXED64:
            if pos + 8 > end:
                raise WireFormatError("truncated fixed64")
            yield number, wire_type, int.from_bytes(view[pos : pos + 8], "little")
            pos += 8
        elif wire_type == FIXED32:
            if pos + 4 > end:
                raise WireFormatError("truncated fixed32")
            yield number, wire_type, int.from_bytes(view[pos : pos + 4], "little")
            pos += 4
        else:
            raise WireFormatError(f"unsupported wire type {wire_type}")


def packed_varints(view: memoryview) -> Iterator[int]:
    pos, end = 0, len(view)
    while pos < end:
        value, pos = read_varint(view, pos)
        yield value
