"""Idle bulk-lane connections a client keeps per peer, so its next exchange skips TCP and TLS setup.

A connection enters the pool only when its exchange was released (:meth:`TlsStream.release
<meshnode.transport.tls_lane.TlsStream.release>`: the reply was read to its end, nothing
was left over, the peer had not ended it); one that was closed or reset never does. At
most ``max_idle_per_peer`` wait per peer (more are closed: the server counts every open
one against its per-peer cap), each for at most ``idle_timeout`` seconds, which is shorter
than the server waits (tls_listener.DEFAULT_IDLE_TIMEOUT_S) so the client gives one up
first. A connection taken from the pool is checked again: one the peer closed meanwhile is
dropped, and the most recently used of the rest is reused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from meshnode.transport.tls_lane import LaneConnection

# What the fetcher keeps busy per source (IN_FLIGHT_PER_SOURCE) and a query beside it.
DEFAULT_MAX_IDLE_PER_PEER = 4
DEFAULT_IDLE_TIMEOUT_S = 10.0


@dataclass
class _Idle:
    connection: LaneConnection
    expiry: asyncio.TimerHandle


class LanePool:
    def __init__(
        self,
        *,
        max_idle_per_peer: int = DEFAULT_MAX_IDLE_PER_PEER,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_timeout = idle_timeout
        self._idle: dict[bytes, list[_Idle]] = {}
        # Connections taken from the pool for another exchange (tests and status).
        self.reused = 0

    def idle_count(self, peer_id: bytes) -> int:
        return len(self._idle.get(peer_id, ()))

    def take(self, peer_id: bytes) -> LaneConnection | None:
        """An idle connection to ``peer_id`` that may carry an exchange, or ``None``."""
        idle = self._idle.get(peer_id)
        while idle:
            entry = idle.pop()
            entry.expiry.cancel()
            if entry.connection.usable:
                self.reused += 1
                self._forget_if_empty(peer_id)
                return entry.connection
            entry.connection.close()
        self._forget_if_empty(peer_id)
        return None

    def put(self, connection: LaneConnection) -> None:
        """Keep ``connection`` (its exchange was released) for the peer's next exchange."""
        idle = self._idle.setdefault(connection.peer_id, [])
        if not connection.usable or len(idle) >= self.max_idle_per_peer:
            connection.close()
            self._forget_if_empty(connection.peer_id)
            return
        expiry = asyncio.get_running_loop().call_later(self.idle_timeout, self._expire, connection)
        idle.append(_Idle(connection, expiry))

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for entry in idle:
                entry.expiry.cancel()
                entry.connection.close()
        self._idle.clear()

    def _expire(self, connection: LaneConnection) -> None:
        idle = self._idle.get(connection.peer_id, [])
        for position, entry in enumerate(idle):
            if entry.connection is connection:
                del idle[position]
                connection.close()
                break
        self._forget_if_empty(connection.peer_id)

    def _forget_if_empty(self, peer_id: bytes) -> None:
        if not self._idle.get(peer_id, True):
            del self._idle[peer_id]


__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_IDLE_PER_PEER", "LanePool"]
