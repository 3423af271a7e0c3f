"""The transport abstraction every mesh protocol runs on.

* :class:`MeshStream` — one bidirectional byte stream to an authenticated peer.
  ``write`` waits while too much is queued (the transport's backpressure), so a
  fast writer cannot grow memory without bound; ``read`` returns ``b""`` at the
  end of the stream and raises :class:`StreamReset` when the peer aborts it.
* :class:`PeerLink` — everything to one peer: opens streams whose first byte is
  the stream type (``open_stream``), closes.
* :class:`LinkHandler` — what a transport tells its owner: a link came up, the
  peer opened a stream, a link went down.

Implementations: QUIC (``meshnode.transport.quic``), the in-process loopback
(``meshnode.transport.loopback``) and, later, relay channels. A relay channel is
a virtual stream whose first payload starts with the stream-type byte, exactly
like a QUIC stream, so the dispatcher and every handler run unchanged over it.
A relay implementation must deliver ``reset(code)`` codes to the peer, because
the mesh protocol reports refusals on send-only streams as reset codes.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Protocol

from meshnode.transport.framed import FramedStream
from meshnode.transport.read_limits import ReadLimits
from meshnode.wire.framing import StreamType

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

    @property
    @abc.abstractmethod
    def stream_id(self) -> int:
        """Transport-specific number, for logs only."""

    @abc.abstractmethod
    async def read(self, max_bytes: int = 65536) -> bytes:
        """Up to ``max_bytes``; ``b""`` once the peer finished. Raises :class:`StreamError`."""

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


class PeerLink(abc.ABC):
    """All streams to one authenticated peer."""

    peer_id: bytes
    # True on the side that dialed; the tie-break between two links needs it.
    initiated_locally: bool
    # Event-loop time when the link became usable.
    established_at: float
    # The relay a relayed link passes through (None: a direct link). A peer that stops
    # answering on a relayed link may still be reachable through another of its relays.
    relay_id: bytes | None = None
    # Event-loop time of the last record the peer sent on this link (-inf: not tracked). A peer
    # that sends while one of our probes waits is slow, not gone.
    last_heard_at: float = float("-inf")
    # Why the link closed ("" while open).
    close_reason: str = ""
    # Set once the link is closed; implementations create it and set it exactly once.
    _closed: asyncio.Event
    # Set once the node keeps another link to the peer instead, and this one closes shortly (a
    # direct link replaced a relayed one): what lives long on it moves over meanwhile.
    _superseded: asyncio.Event | None = None

    @abc.abstractmethod
    async def open_raw_stream(self) -> MeshStream:
        """A new stream with nothing written yet."""

    async def open_stream(self, stream_type: StreamType) -> FramedStream:
        """A new stream whose type byte is queued; send frames on it next."""
        stream = await self.open_raw_stream()
        await stream.write(bytes((int(stream_type),)))
        return FramedStream(stream, expect_stream_type=False, stream_type=stream_type)

    @property
    def is_closed(self) -> bool:
        return self._closed.is_set()

    @abc.abstractmethod
    def close(self, reason: str = "") -> None:
        """Close the link and every stream on it; idempotent."""

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def supersede(self) -> None:
        """Another link to the peer replaces this one, which stays open a little longer."""
        if self._superseded is None:
            self._superseded = asyncio.Event()
        self._superseded.set()

    async def wait_superseded(self) -> None:
        if self._superseded is None:
            self._superseded = asyncio.Event()
        await self._superseded.wait()

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """Human-readable transport and remote address, for logs and status."""


class LinkHandler(Protocol):
    def link_established(self, link: PeerLink) -> None:
        """A link is authenticated and usable (called for dialed and accepted links)."""

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        """The peer opened ``stream``; the owner must read its type byte and serve it."""

    def link_closed(self, link: PeerLink, reason: str) -> None:
        """The link is gone; its streams raise :class:`LinkClosed`."""


__all__ = [
    "RESET_CANCELLED",
    "LinkClosed",
    "LinkHandler",
    "MeshStream",
    "PeerLink",
    "StreamError",
    "StreamReset",
]
