"""Typed protocol errors.

Two families: framing errors (the byte stream itself is broken; the stream is
closed) and shard protocol errors (a well-framed message asks for something the
receiver refuses; it travels back to the sender as a ``ShardError`` with its exact
``ErrorCode``).
"""

from __future__ import annotations

from meshnode.wire.pb import shard


class MeshnodeError(Exception):
    """Base of every error meshnode raises on purpose."""


class FramingError(MeshnodeError):
    """The byte stream does not frame as ``[type][len][body]...``."""


class FrameTooLarge(FramingError):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the {limit}-byte cap")
        self.length = length
        self.limit = limit


class TruncatedFrame(FramingError):
    def __init__(self, buffered: int, expected: int) -> None:
        super().__init__(f"stream ended inside a frame ({buffered} of {expected} bytes)")
        self.buffered = buffered
        self.expected = expected


class UnknownStreamType(FramingError):
    def __init__(self, value: int) -> None:
        super().__init__(f"unknown stream type 0x{value:02x}")
        self.value = value


class BufferLimitExceeded(FramingError):
    """Holding more of an incomplete frame would pass a buffer cap (``scope`` names which)."""

    def __init__(self, scope: str, held: int, wanted: int, limit: int) -> None:
        super().__init__(
            f"{scope} buffer for incomplete frames is full ({held} of {limit} bytes held, {wanted} more arrived)"
        )
        self.scope = scope
        self.held = held
        self.wanted = wanted
        self.limit = limit


class FrameStalled(FramingError):
    """The stream sent nothing for ``timeout`` seconds in the middle of a frame."""

    def __init__(self, buffered: int, timeout: float) -> None:
        super().__init__(f"stream stalled mid-frame for {timeout:g} s ({buffered} bytes held)")
        self.buffered = buffered
        self.timeout = timeout


class ShardProtocolError(MeshnodeError):
    """A refusal that maps onto ``meshnet.shard.v1.ErrorCode``.

    ``detail`` must be safe to send to a peer: no paths, no exception text.
    """

    code: shard.ErrorCode = shard.ERROR_CODE_INTERNAL
    retryable: bool = False

    def __init__(
        self,
        detail: str,
        *,
        code: shard.ErrorCode | None = None,
        retryable: bool | None = None,
        actual_past_len: int = 0,
    ) -> None:
        super().__init__(detail)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        self.detail = detail
        self.actual_past_len = actual_past_len

    @property
    def code_name(self) -> str:
        return shard.ErrorCode.Name(self.code)

    def to_pb(self) -> shard.ShardError:
        return shard.ShardError(
            code=self.code,
            detail=self.detail,
            retryable=self.retryable,
            actual_past_len=self.actual_past_len,
        )

    @classmethod
    def from_pb(cls, error: shard.ShardError) -> ShardProtocolError:
        return cls(
            error.detail,
            code=error.code,
            retryable=error.retryable,
            actual_past_len=error.actual_past_len,
        )

    def __str__(self) -> str:
        return f"{self.code_name}: {self.detail}"


class PayloadCorrupt(ShardProtocolError):
    """Tensor payload failed validation: checksum, tiling, enums, shape, budget."""

    code = shard.ERROR_CODE_PAYLOAD_CORRUPT
