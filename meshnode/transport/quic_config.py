"""How a QUIC endpoint behaves (:class:`QuicConfig`), apart from the QUIC machinery itself so
that the command line reads its defaults without loading aioquic."""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.transport.read_limits import DEFAULT_CONNECTION_BUFFER_BYTES, DEFAULT_STALL_TIMEOUT_S
from meshnode.wire.framing import ALPN

# The smallest datagram QUIC lets a path carry (RFC 9000 section 14; aioquic's
# SMALLEST_MAX_DATAGRAM_SIZE): what a link sends before it knows better.
SMALLEST_MAX_DATAGRAM_SIZE = 1200


@dataclass(frozen=True)
class QuicConfig:
    # Receive credit: at most this many unread bytes per stream / per connection.
    stream_window: int = 1024 * 1024
    connection_window: int = 4 * 1024 * 1024
    # Send side: `write` waits while more than this is unacknowledged.
    max_stream_backlog: int = 1024 * 1024
    max_connection_backlog: int = 4 * 1024 * 1024
    # And while more than this per stream is written but not yet sent (None: no such limit). A
    # connection that carries many conversations on one stream (a relay client's) keeps what
    # waits in its own queues, where they take turns, not in QUIC's, where a step waits behind
    # all of a transfer; what is in flight is still the congestion and flow control's to size.
    max_stream_unsent: int | None = None
    idle_timeout: float = 30.0
    keepalive_interval: float = 10.0
    handshake_timeout: float = 5.0
    max_links: int = 256
    max_datagram_size: int = SMALLEST_MAX_DATAGRAM_SIZE
    # Another protocol on the same machinery (the relay uses ``meshnode-relay/1``).
    alpn: str = ALPN
    # How long a received packet may wait for its ACK to ride on outgoing data
    # (seconds; aioquic's own default is 1 ms). None keeps aioquic's default.
    ack_delay: float | None = 0.005
    # The longest a peer's ACK may take, for our probe timeout (seconds). Every peer of this
    # endpoint is a meshnode endpoint (the ALPN says so), acknowledging within its ack_delay
    # above; aioquic tells peers 25 ms whatever it does, and a packet lost with nothing sent
    # after it (a decode step's last, a small window's under loss) waits that long more to be
    # resent. None keeps what the peer advertises.
    peer_max_ack_delay: float | None = 0.010
    # Bytes of incomplete frames a link's readers may hold; and how long a reader
    # waits mid-frame for more before giving the stream up (None: forever).
    frame_buffer_per_connection: int = DEFAULT_CONNECTION_BUFFER_BYTES
    frame_stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S


__all__ = ["SMALLEST_MAX_DATAGRAM_SIZE", "QuicConfig"]
