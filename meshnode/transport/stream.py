"""One bidirectional byte stream to an authenticated peer, and how it fails.

:class:`MeshStream` is what every transport hands out (QUIC, the in-process
loopback, a relay channel) and what :class:`~meshnode.transport.framed.FramedStream`
frames: ``write`` waits while too much is queued (the transport's backpressure),
so a fast writer cannot grow memory without bound; ``read`` returns ``b""`` at
the end of the stream and raises :class:`StreamReset` when the peer aborts it.
The link that opens streams is :class:`~meshnode.transport.base.PeerLink`.
"""

from __future__ import annotations

import abc

from meshnode.transport.read_limits import ReadLimits

# Reset code for a stream aborted without a protocol reason (e.g. task cancelled).
RESET_CANCELLED = 0x01


class StreamError(Exception):
    """A stream can no longer be used."""


class StreamReset(StreamError):
    def __init__(self, error_code: int, *, by_peer: bool = True) -> None:
        who = "peer" if by_peer else "local side"
        super().__init__(f"stream reset by {who} (code 0x{error_code:x})")
        self.error_code = error_code
        self.by_peer = by_peer


class LinkClosed(StreamError):
    def __init__(self, reason: str = "link closed") -> None:
        super().__init__(reason)
        self.reason = reason


class MeshStream(abc.ABC):
    """One bidirectional byte stream to ``peer_id`` (authenticated by the transport)."""

    peer_id: bytes
    # Shared by the streams of one link; FramedStream applies them. None: no caps.
    read_limits: ReadLimits | None = None
    # The largest read :meth:`readexactly` takes (0: it is not offered). A transport whose own
    # reader holds that much anyway offers it, so that FramedStream reads a frame in two calls
    # (its length, then its body) instead of in pieces through its decoder.
    exact_read_bytes: int = 0

    @property
    @abc.abstractmethod
    def stream_id(self) -> int:
        """Transport-specific number, for logs only."""

    @abc.abstractmethod
    async def read(self, max_bytes: int = 65536) -> bytes:
        """Up to ``max_bytes``; ``b""`` once the peer finished. Raises :class:`StreamError`."""

    async def readexactly(self, nbytes: int) -> bytes:
        """Exactly ``nbytes`` (at most :attr:`exact_read_bytes`); ``asyncio.IncompleteReadError``
        holding what came if the peer finished first. Raises :class:`StreamError` as :meth:`read`."""
        raise NotImplementedError(f"{type(self).__name__} offers no exact reads")

    @abc.abstractmethod
    async def write(self, data: bytes) -> None:
        """Queue ``data``, first waiting while the stream or link has too much unacknowledged."""

    @abc.abstractmethod
    def finish(self) -> None:
        """End our direction cleanly (the peer reads ``b""`` after the data)."""

    @abc.abstractmethod
    def reset(self, error_code: int) -> None:
        """Abort both directions; the peer's reads and writes raise ``StreamReset(error_code)``."""

    def close(self) -> None:
        """Done with the stream: finish our direction (if still open) and stop reading.

        Whatever the peer still sends is discarded and its flow-control credit
        released, so a peer cannot pin a link's receive window with bytes nobody
        will read. Call it when a stream's conversation is over. Implementations
        with receive buffers override this; the default only finishes.
        """
        self.finish()

    def release(self) -> None:
        """Done with a stream whose conversation ended cleanly (every message of it read and
        written): a transport that carries conversations one after another on one connection
        (the bulk lane) may carry the next on it. Any other closes the stream (:meth:`close`)."""
        self.close()


__all__ = [
    "RESET_CANCELLED",
    "LinkClosed",
    "MeshStream",
    "StreamError",
    "StreamReset",
]
