"""The write side that QUIC streams and relay channels share: pieces as the peer's credit allows.

Both keep a ``send_error`` (what a write raises once the stream can no longer send) and a
link with a ``progress`` event, ``is_closed`` and ``close_reason``; they differ only in how
much may go now and how a piece is sent, which subclasses say.
"""

from __future__ import annotations

import abc
from typing import Protocol

from meshnode.transport.base import LinkClosed, MeshStream
from meshnode.transport.buffers import Progress, write_as_credit_allows


class CreditedLink(Protocol):
    progress: Progress

    @property
    def is_closed(self) -> bool: ...

    @property
    def close_reason(self) -> str: ...


class CreditedStream(MeshStream):
    _link: CreditedLink
    send_error: Exception | None

    async def write(self, data: bytes) -> None:
        await write_as_credit_allows(
            data,
            self._link.progress,
            check_writable=self._check_writable,
            credit=self._send_credit,
            send=self._send_piece,
        )

    def _check_writable(self) -> None:
        if self.send_error is not None:
            raise self.send_error
        if self._link.is_closed:
            raise LinkClosed(self._link.close_reason)

    @abc.abstractmethod
    def _send_credit(self) -> int:
        """How many bytes may be sent now (0: wait for progress)."""

    @abc.abstractmethod
    def _send_piece(self, piece: memoryview) -> None:
        """Send the whole piece, or raise."""


__all__ = ["CreditedLink", "CreditedStream"]
