"""Where a session's streams come from, writing its frames, and dropping a stream without a fuss (asyncio edge)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from meshnode.dataplane.errors import SessionTransportError
from meshnode.transport.base import RESET_CANCELLED, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.wire.errors import MeshnodeError
from meshnode.wire.framing import encode_frame

# One link, or a factory that gives the link to use now (a session re-dials through it).
LinkFactory = Callable[[], Awaitable[PeerLink]]
LinkSource = PeerLink | LinkFactory

# Frames below this are joined into one write (one QUIC frame); larger ones are written as they are.
_JOIN_BELOW_BYTES = 64 * 1024


class SessionLinks:
    """The link a session's streams go over now: the one given, or the latest its factory gave
    while it stays open (a closed one is asked for again; a single link that closed is the end)."""

    def __init__(self, links: LinkSource) -> None:
        self._links = links
        self.link: PeerLink | None = links if isinstance(links, PeerLink) else None

    async def current(self) -> PeerLink:
        if self.link is not None and not self.link.is_closed:
            return self.link
        if isinstance(self._links, PeerLink):
            raise SessionTransportError(f"the link is closed ({self._links.description})")
        try:
            self.link = await self._links()
        except (MeshnodeError, ConnectionError, OSError, TimeoutError) as exc:
            raise SessionTransportError(f"no link to the worker: {exc or type(exc).__name__}") from None
        return self.link


async def write_frames(framed: FramedStream, bodies: list[bytes]) -> None:
    stream = framed.stream
    if sum(len(b) for b in bodies) < _JOIN_BELOW_BYTES:
        await stream.write(b"".join([encode_frame(b) for b in bodies]))
        return
    for body in bodies:
        await framed.send_frame(body)


def reset_quietly(framed: FramedStream | None) -> None:
    if framed is None:
        return
    # Already reset, or the link is gone: nothing left to abort.
    with contextlib.suppress(Exception):
        framed.reset(RESET_CANCELLED)


__all__ = ["LinkFactory", "LinkSource", "SessionLinks", "reset_quietly", "write_frames"]
