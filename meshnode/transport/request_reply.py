"""One request and its one reply on a fresh stream: how every unary mesh and shard call is made.

The mesh's gossip, probe, PeerDown and PeerLeaving calls and the shard's
GetCapability, Health, Cancel and Release all open a stream, write one frame,
finish and read one reply frame. :func:`request_reply` is that exchange, with
the one mapping of its failures: a stream reset carrying a mesh error code is
the peer's :class:`~meshnode.wire.mesh_refusal.RemoteRefusal`; every other
failure stays the transport's own type, all of them listed in
:data:`REQUEST_FAILURES` so a caller catches exactly what the call can raise.
"""

from __future__ import annotations

import asyncio

from meshnode.transport.base import PeerLink, StreamError, StreamReset
from meshnode.wire.errors import FramingError
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import RemoteRefusal, refusal_from_reset_code

# What request_reply raises: the peer refused the stream (RemoteRefusal); the stream or link broke
# (StreamError, LinkClosed among them, or a ConnectionError from a transport beneath); a frame was
# too large or cut short (FramingError); no reply within the timeout (TimeoutError).
REQUEST_FAILURES: tuple[type[Exception], ...] = (
    RemoteRefusal,
    StreamError,
    ConnectionError,
    FramingError,
    TimeoutError,
)


async def request_reply(
    link: PeerLink, stream_type: StreamType, body: bytes, *, timeout: float | None
) -> bytes | None:
    """Send ``body`` as one frame on a new ``stream_type`` stream and return the one reply frame.

    ``None``: the peer ended the stream cleanly without replying (how PeerDown and
    PeerLeaving are acknowledged). ``timeout`` bounds the whole exchange, opening
    included; ``None`` leaves it to a deadline the caller already runs under.
    The stream is always closed afterwards, so anything more the peer sends is
    discarded and its flow-control credit released, not buffered. Raises one of
    :data:`REQUEST_FAILURES`.
    """
    async with asyncio.timeout(timeout):
        stream = await link.open_stream(stream_type)
        try:
            await stream.send_frame(body)
            stream.finish()
            return await stream.recv_frame()
        except StreamReset as exc:
            refusal = refusal_from_reset_code(exc.error_code)
            if refusal is not None:
                raise refusal from None
            raise
        finally:
            stream.close()


__all__ = ["REQUEST_FAILURES", "request_reply"]
