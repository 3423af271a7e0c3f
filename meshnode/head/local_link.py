"""A link from this process to its own shard server, through the in-process loopback transport.

When the first hop of a route is this very node, the head still talks to it as
to any peer — the same session protocol over a :class:`~meshnode.transport.base.PeerLink`
— only without sockets. Streams opened on the link are served by a dispatcher
of their own that admits only this node's id, so nothing outside the process
reaches it.
"""

from __future__ import annotations

import logging

from meshnode.mesh.dispatcher import CallerLinkHandler, Dispatcher, DispatchingLinkHandler, StreamHandler
from meshnode.transport.base import PeerLink
from meshnode.transport.loopback import LoopbackLink, loopback_link_pair
from meshnode.wire.framing import StreamType

log = logging.getLogger(__name__)


class LocalShardLink:
    """Serve handlers registered with :meth:`register` (e.g. ``ShardServer.register``) to this process."""

    def __init__(self, node_id: bytes, *, stream_type_timeout: float = 5.0) -> None:
        self.node_id = node_id
        self.dispatcher = Dispatcher(
            is_admitted=lambda peer_id: peer_id == node_id, stream_type_timeout=stream_type_timeout
        )
        self._link: LoopbackLink | None = None

    def register(self, stream_type: StreamType, handler: StreamHandler) -> None:
        self.dispatcher.register(stream_type, handler)

    async def link(self) -> PeerLink:
        if self._link is None or self._link.is_closed:
            self._link, _ = loopback_link_pair(
                self.node_id, self.node_id, CallerLinkHandler(), DispatchingLinkHandler(self.dispatcher)
            )
        return self._link

    async def aclose(self) -> None:
        if self._link is not None:
            self._link.close("local shard link closed")
        await self.dispatcher.aclose()


__all__ = ["LocalShardLink"]
