"""The transport abstraction every mesh protocol runs on.

* :class:`MeshStream` — one bidirectional byte stream to an authenticated peer,
  and its errors (:class:`StreamReset`, :class:`LinkClosed`). They are defined in
  :mod:`meshnode.transport.stream`, below the framing that wraps a stream, and
  exported here with the link so that a protocol imports the abstraction from
  one place.
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
from meshnode.transport.stream import RESET_CANCELLED, LinkClosed, MeshStream, StreamError, StreamReset
from meshnode.wire.framing import StreamType


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
    # Streams the peer opened on the link since it came up (where ``stream_count`` is tracked):
    # a link whose count has not moved since some moment served no stream since.
    streams_accepted: int = 0
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

    @property
    def stream_count(self) -> int | None:
        """Streams open on the link; None where the link type does not track them (then whoever
        closes idle links keeps it)."""
        return None

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
