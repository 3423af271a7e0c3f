"""Serve ARTIFACT requests on the bulk lane (TLS over TCP) with the ARTIFACT stream's own handler.

Each exchange on a lane connection is one stream, as on QUIC: its type byte, then the
request and the reply; a connection carries the peer's exchanges one after another
(:mod:`meshnode.transport.tls_lane`). Each goes through a
:class:`~meshnode.mesh.dispatcher.Dispatcher` holding only the ARTIFACT handler (any
other stream type is refused), with the QUIC side's admission (``is_admitted``, and
``check_peer`` refusing a removed node) checked by the listener before the connection
is served, and by the dispatcher on every exchange, as for every QUIC stream. Uploads run in the same :class:`~.server.ArtifactServer`, so the same
:class:`~.upload_limit.UploadLimiter` paces them and the same per-peer upload limit
counts QUIC and lane uploads together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from meshnode.artifacts.server import ArtifactServer
from meshnode.mesh.dispatcher import Dispatcher
from meshnode.transport.tls_lane import LaneContexts
from meshnode.transport.tls_listener import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PER_PEER,
    TlsLaneListener,
)
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal

log = logging.getLogger(__name__)

STREAM_TYPE_TIMEOUT_S = 5.0


class BulkLaneServer:
    def __init__(
        self,
        artifacts: ArtifactServer,
        contexts: LaneContexts,
        *,
        is_admitted: Callable[[bytes], bool],
        check_peer: Callable[[bytes], None],
        admitted: Callable[[], Iterable[bytes]],
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self._is_admitted = is_admitted
        self._check_peer = check_peer
        self.dispatcher = Dispatcher(
            is_admitted=is_admitted, check_peer=check_peer, stream_type_timeout=STREAM_TYPE_TIMEOUT_S
        )
        self.dispatcher.register(StreamType.ARTIFACT, artifacts.handle)
        self.listener = TlsLaneListener(
            contexts,
            self.dispatcher.serve,
            admits=self._admits,
            trusted=admitted,
            handshake_timeout=handshake_timeout,
            max_connections=max_connections,
            max_per_peer=max_per_peer,
            idle_timeout=idle_timeout,
        )

    async def listen(self, host: str, port: int) -> bool:
        """Listen on TCP ``host:port``; False (logged) where it cannot, and artifacts go over QUIC only."""
        try:
            await self.listener.listen(host, port)
        except OSError as exc:
            log.warning("%s; artifacts are served over QUIC only", exc)
            return False
        log.info("bulk lane: serving artifacts over TLS on TCP %s:%d", *self.listener.local_address)
        return True

    async def close(self) -> None:
        await self.listener.close()
        await self.dispatcher.aclose()

    def _admits(self, peer_id: bytes) -> bool:
        try:
            self._check_peer(peer_id)
        except MeshRefusal:
            return False
        return self._is_admitted(peer_id)


__all__ = ["BulkLaneServer"]
