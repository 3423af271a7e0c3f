"""Serve accepted streams: read the type byte, apply admission, call the registered handler.

Depends only on :class:`~meshnode.transport.base.MeshStream`, so it serves QUIC
streams and relay channels alike. Every way a stream can fail ends in a reset
with a ``MeshErrorCode`` (see :func:`~meshnode.wire.mesh_refusal.reset_code`), never in
an exception escaping into the transport; the link stays up.

Handlers are ``async def handler(stream: FramedStream) -> None``. They may raise
:class:`~meshnode.wire.mesh_refusal.MeshRefusal` (the stream is reset with its code),
``TimeoutError`` (reset as READ_TIMEOUT) or a framing error (FRAME_TOO_LARGE;
OVERLOADED when the link's or the node's buffer for incomplete frames is full;
READ_TIMEOUT when the peer stalled mid-frame; MALFORMED otherwise). When a
handler returns, the dispatcher releases the stream (its conversation ended
cleanly, :meth:`~meshnode.transport.stream.MeshStream.release`): a QUIC stream is
closed, finished if the handler did not finish it, and whatever the peer sends after
that is discarded; a bulk-lane connection may then carry the peer's next exchange.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from meshnode.identity import short_id
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.mesh.rules import stream_allowed_before_admission
from meshnode.transport.base import RESET_CANCELLED, MeshStream, PeerLink, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.wire.errors import (
    BufferLimitExceeded,
    FrameStalled,
    FrameTooLarge,
    FramingError,
    UnknownStreamType,
)
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, reset_code
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

StreamHandler = Callable[[FramedStream], Awaitable[None]]


@dataclass(frozen=True)
class _Registration:
    handler: StreamHandler
    before_admission: bool


class Dispatcher:
    def __init__(
        self,
        *,
        is_admitted: Callable[[bytes], bool],
        stream_type_timeout: float = 5.0,
        max_concurrent_streams: int = 1024,
        check_peer: Callable[[bytes], None] | None = None,
    ) -> None:
        self._is_admitted = is_admitted
        # Raises the MeshRefusal that says why a peer is shut out (MESH_ERROR_REVOKED), which
        # is more use to it than NOT_ADMITTED; gossip is still served, to show it the revocation.
        self._check_peer = check_peer
        self.stream_type_timeout = stream_type_timeout
        self._handlers: dict[StreamType, _Registration] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_concurrent = max_concurrent_streams
        self.refusals: dict[str, int] = {}
        # A peer sending garbage must not flood the log.
        self._refusal_log = RateLimitedLog(log)

    def register(
        self, stream_type: StreamType, handler: StreamHandler, *, before_admission: bool = False
    ) -> None:
        """Serve ``stream_type`` with ``handler``; only admitted peers unless ``before_admission``."""
        if before_admission and not stream_allowed_before_admission(stream_type):
            raise ValueError(f"{stream_type.name} may not be served before admission")
        if stream_type in self._handlers:
            raise ValueError(f"a handler for {stream_type.name} is already registered")
        self._handlers[stream_type] = _Registration(handler, before_admission)

    def accept(self, stream: MeshStream) -> None:
        """Serve ``stream`` in its own task (call from a transport's ``stream_accepted``)."""
        if len(self._tasks) >= self._max_concurrent:
            self._refuse(stream, MeshRefusal(mesh.MESH_ERROR_OVERLOADED, "too many open streams"))
            return
        task = asyncio.get_running_loop().create_task(self.serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def serve(self, stream: MeshStream) -> None:
        framed = FramedStream(stream, expect_stream_type=True)
        try:
            try:
                stream_type = await framed.read_stream_type(self.stream_type_timeout)
            except TimeoutError:
                raise MeshRefusal(mesh.MESH_ERROR_STREAM_TYPE_TIMEOUT) from None
            except UnknownStreamType as exc:
                raise MeshRefusal(mesh.MESH_ERROR_UNKNOWN_STREAM_TYPE, str(exc)) from None
            except FramingError as exc:  # ended before the type byte
                raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, str(exc)) from None
            registration = self._handlers.get(stream_type)
            if registration is None:
                raise MeshRefusal(
                    mesh.MESH_ERROR_UNKNOWN_STREAM_TYPE, f"{stream_type.name} is not served here"
                )
            if not registration.before_admission and self._check_peer is not None:
                self._check_peer(stream.peer_id)
            if not registration.before_admission and not self._is_admitted(stream.peer_id):
                raise MeshRefusal(mesh.MESH_ERROR_NOT_ADMITTED, f"{stream_type.name} before admission")
            try:
                await registration.handler(framed)
            except TimeoutError:
                raise MeshRefusal(mesh.MESH_ERROR_READ_TIMEOUT) from None
            except FrameTooLarge as exc:
                raise MeshRefusal(mesh.MESH_ERROR_FRAME_TOO_LARGE, str(exc)) from None
            except BufferLimitExceeded as exc:
                raise MeshRefusal(mesh.MESH_ERROR_OVERLOADED, str(exc)) from None
            except FrameStalled as exc:
                raise MeshRefusal(mesh.MESH_ERROR_READ_TIMEOUT, str(exc)) from None
            except FramingError as exc:
                raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, str(exc)) from None
            framed.release()
        # Resetting through `framed` also gives back what it held of a partial frame.
        except MeshRefusal as refusal:
            self._refuse(framed, refusal)
        except StreamError:
            # The peer reset the stream or the link went away: nothing to answer, but
            # end our direction too so the stream's state is released.
            framed.reset(RESET_CANCELLED)
        except asyncio.CancelledError:
            framed.reset(reset_code(mesh.MESH_ERROR_INTERNAL))
            raise
        except Exception:
            log.exception("stream handler failed (peer %s)", short_id(stream.peer_id))
            self._refuse(framed, MeshRefusal(mesh.MESH_ERROR_INTERNAL))

    def _refuse(self, stream: MeshStream | FramedStream, refusal: MeshRefusal) -> None:
        self.refusals[refusal.code_name] = self.refusals.get(refusal.code_name, 0) + 1
        stream.reset(refusal.reset_code)
        self._refusal_log.log(logging.INFO, "refused stream from %s: %s", short_id(stream.peer_id), refusal)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["Dispatcher", "StreamHandler"]


class DispatchingLinkHandler:
    """A :class:`~meshnode.transport.base.LinkHandler` that serves every stream a
    peer opens with ``dispatcher`` and has nothing to do when links come and go."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def link_established(self, link: PeerLink) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.dispatcher.accept(stream)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass


class CallerLinkHandler:
    """The handler of an end that only opens streams: one a peer opens is reset."""

    def link_established(self, link: PeerLink) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        stream.reset(RESET_CANCELLED)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        pass
