"""The bulk lane's listening side: TCP accepted, TLS completed, the peer admitted, then served.

A connection costs the node a TCP accept and at most one handshake before it is refused:
a client whose certificate does not carry the key of a node the lane trusts fails inside
OpenSSL's handshake (as a stranger's QUIC handshake fails in aioquic's), the handshake
must finish within ``handshake_timeout``, and at most ``max_connections`` connections
(handshaking or served) are open at once (one more is refused at its ClientHello, before
the server signs anything), ``max_per_peer`` of them per node. Only after
that does ``admits`` decide, with the node id the handshake proved, and only an admitted
peer's connection reaches ``serve``, one exchange at a time, each a
:class:`~meshnode.transport.tls_lane.TlsStream`. An exchange that ``serve`` released (its
reply ended cleanly) lets the connection carry the peer's next one; the listener waits at
most ``idle_timeout`` for it, then closes the connection. Each exchange is judged afresh by
``serve`` (the dispatcher checks admission on every stream), so a peer removed while its
connection is open is refused at its next request.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable

from meshnode.identity import short_id
from meshnode.transport.bind_errors import listen_error
from meshnode.transport.read_limits import ReadLimits, process_budget
from meshnode.transport.tls_lane import (
    READ_BUFFER_BYTES,
    LaneConnection,
    LaneContexts,
    LaneDialError,
    TlsStream,
    abort_with_reset,
    authenticated_peer,
)

log = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_PER_PEER = 8
# How long a connection waits for the peer's next exchange. Longer than the client's pool
# keeps it idle (lane_pool.DEFAULT_IDLE_TIMEOUT_S), so a client never sends a request into
# a connection the server is closing; short enough that idle connections do not hold slots.
DEFAULT_IDLE_TIMEOUT_S = 20.0
# What a lane connection's reader may hold of incomplete frames (requests are a few bytes).
_CONNECTION_BUFFER_BYTES = 1 << 20
_STALL_TIMEOUT_S = 30.0


class TlsLaneListener:
    def __init__(
        self,
        contexts: LaneContexts,
        serve: Callable[[TlsStream], Awaitable[None]],
        *,
        admits: Callable[[bytes], bool],
        trusted: Callable[[], Iterable[bytes]],
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.contexts = contexts
        self._serve = serve
        # Whether the QUIC side would serve this peer now (admitted, not removed).
        self._admits = admits
        # The nodes whose certificates may complete a handshake (refreshed at each accept).
        self._trusted = trusted
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.idle_timeout = idle_timeout
        self._open = 0
        # When each handshake under way began (see _client_hello).
        self._handshakes: deque[float] = deque()
        self.handshakes_begun = 0
        self._by_peer: Counter[bytes] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        # Connections refused, by reason (status and tests).
        self.refusals: Counter[str] = Counter()
        # Connections admitted, and exchanges served on them, per peer.
        self.served: Counter[bytes] = Counter()
        self.exchanges: Counter[bytes] = Counter()

    async def listen(self, host: str, port: int) -> None:
        """Start accepting on TCP ``host:port``; raises ListenError when it cannot be bound."""
        # At each ClientHello, before the handshake's costly part (and before the client's
        # certificate is checked against the trusted nodes, refreshed there).
        self.contexts.server.sni_callback = self._client_hello
        try:
            self._server = await asyncio.start_server(
                self._accept,
                host,
                port,
                ssl=self.contexts.server,
                ssl_handshake_timeout=self.handshake_timeout,
                limit=READ_BUFFER_BYTES,
            )
        except OSError as exc:
            raise listen_error("TCP", host, port, exc) from exc

    @property
    def local_address(self) -> tuple[str, int]:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    def connections_of(self, peer_id: bytes) -> int:
        return self._by_peer[peer_id]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _client_hello(
        self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> int | None:
        """Refuse a handshake beyond ``max_connections`` (served ones, and those begun within the
        handshake timeout, the longest one can last); else let it go on, trusting who may pass now."""
        now = time.monotonic()
        while self._handshakes and self._handshakes[0] <= now - self.handshake_timeout:
            self._handshakes.popleft()
        if self._open + len(self._handshakes) >= self.max_connections:
            self.refusals["busy"] += 1
            return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE
        self._handshakes.append(now)
        self.handshakes_begun += 1
        self.contexts.trust(self._trusted())
        return None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called once the handshake succeeded: the client showed a certificate of a trusted node.
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        if self._handshakes:
            self._handshakes.popleft()
        self._open += 1
        try:
            await self._admit_and_serve(reader, writer)
        except asyncio.CancelledError:
            # Only close() cancels it (a connection waiting for its next exchange, say), and
            # asyncio's stream server would log a connection task that ends cancelled as an error.
            pass
        finally:
            self._open -= 1
            self._tasks.discard(task)

    async def _admit_and_serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer_id = authenticated_peer(writer)
        except LaneDialError as exc:
            self._refuse(writer, "handshake", str(exc))
            return
        if not self._admits(peer_id):
            self._refuse(writer, "not_admitted", f"{short_id(peer_id)} is not admitted")
            return
        if self._by_peer[peer_id] >= self.max_per_peer:
            self._refuse(
                writer, "peer_busy", f"{self.max_per_peer} lane connections from {short_id(peer_id)}"
            )
            return
        self._by_peer[peer_id] += 1
        limits = ReadLimits(
            budget=process_budget().child(_CONNECTION_BUFFER_BYTES), stall_timeout=_STALL_TIMEOUT_S
        )
        connection = LaneConnection(reader, writer, peer_id, limits)
        try:
            self.served[peer_id] += 1
            first_byte = b""
            while True:
                stream = connection.stream(unread=first_byte)
                self.exchanges[peer_id] += 1
                await self._serve(stream)
                if not stream.released:
                    break
                first_byte = await connection.next_exchange(self.idle_timeout)
                if not first_byte:
                    break
        finally:
            self._by_peer[peer_id] -= 1
            if not self._by_peer[peer_id]:
                del self._by_peer[peer_id]
            connection.close()

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, detail: str) -> None:
        self.refusals[reason] += 1
        peer = writer.get_extra_info("peername")
        log.debug("refused lane connection from %s: %s", peer, detail)
        abort_with_reset(writer)


__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_PER_PEER",
    "TlsLaneListener",
]
