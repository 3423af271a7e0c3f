"""aioquic configuration and the two behaviours meshnode needs that aioquic lacks.

Everything here that reaches into aioquic's private state is in this module, and
``tests/transport/test_mesh_quic.py`` pins each behaviour, so an aioquic upgrade
that moves them fails loudly instead of silently weakening the node:

1. **Mutual authentication.** aioquic only asks for a client certificate when its
   TLS context's ``_request_client_certificate`` flag is set (it has no public
   switch and no verification callback). The server sets it; both sides then read
   the peer certificate's Ed25519 key after the handshake (:meth:`peer_public_key`)
   and compare it with the node id they expect. TLS itself proved possession of
   that key (CertificateVerify), so the key *is* the authenticated node id.
   Session tickets are never configured: a resumed session would skip certificates.

2. **No frames for streams beyond the peer's stream limit** (see the methods below).

3. **Receive flow control driven by the application.** aioquic doubles a
   stream's and the connection's receive window whenever half of it is used,
   whether or not anyone read the data, so a peer can make the receiver buffer
   without bound. Here credit is granted only for bytes the application consumed:
   a stream may have at most ``stream_window`` unread bytes, a connection
   ``connection_window``. Senders then stall in QUIC flow control and their own
   bounded send backlog (``meshnode.transport.quic``) makes ``write`` wait.
"""

from __future__ import annotations

import ssl
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketPacer
from cryptography import x509

from meshnode.identity import NodeIdentity
from meshnode.transport.node_certificate import certificate_node_id, self_signed_certificate
from meshnode.wire.framing import ALPN


def quic_configuration(
    identity: NodeIdentity,
    certificate: x509.Certificate,
    *,
    is_client: bool,
    stream_window: int,
    connection_window: int,
    idle_timeout: float,
    max_datagram_size: int,
    alpn: str = ALPN,
) -> QuicConfiguration:
    return QuicConfiguration(
        is_client=is_client,
        alpn_protocols=[alpn],
        certificate=certificate,
        private_key=identity.private_key,
        # Chain validation is meaningless for self-signed node keys; the peer's key
        # is checked against the expected node id after the handshake instead.
        verify_mode=ssl.CERT_NONE,
        server_name="meshnode" if is_client else None,
        idle_timeout=idle_timeout,
        max_data=connection_window,
        max_stream_data=stream_window,
        max_datagram_size=max_datagram_size,
    )


# The event loop's clock and timers move in steps of about a millisecond (uvloop's
# loop.time() is libuv's millisecond clock; epoll waits in whole milliseconds).
LOOP_CLOCK_TICK_S = 0.001


class LoopClockPacer(QuicPacketPacer):
    """aioquic's pacer with a burst allowance of at least one tick of the loop's clock.

    aioquic sizes its burst bucket in microseconds: 16 packets, or fewer once the
    pacing rate is so high that its 1 µs floor on the per-packet time bites (a
    multi-megabyte window over a ~1 ms loopback RTT leaves room for about 5 packets).
    Time only advances by whole ticks here, so the bucket refilled at most once per
    millisecond and a sender could not beat ~5-16 packets per millisecond whatever its
    window: prefill transfers fell to 37-57 Mbit/s whenever the window had grown large
    (bench/dataplane.py, bench/RESULTS.md). A bucket of one tick lets each tick carry
    the rate's worth of packets; pacing finer than the clock was never possible anyway.
    """

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        super().update_rate(congestion_window=congestion_window, smoothed_rtt=smoothed_rtt)
        self.bucket_max = max(self.bucket_max, LOOP_CLOCK_TICK_S)


class MeshQuicConnection(QuicConnection):
    def __init__(
        self,
        *,
        stream_window: int,
        connection_window: int,
        ack_delay: float | None = None,
        peer_max_ack_delay: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._peer_max_ack_delay = peer_max_ack_delay
        self._loss._pacer = LoopClockPacer(max_datagram_size=self._max_datagram_size)
        if ack_delay is not None:
            # aioquic acknowledges only on a timer, 1 ms after an ack-eliciting
            # packet. A request answered later than that costs a separate ACK
            # datagram each way; waiting a little longer lets the ACK ride on the
            # answer. It stays below the 10 ms a meshnode peer counts for it in its
            # probe timeout (QuicConfig.peer_max_ack_delay; aioquic advertises 25).
            self._ack_delay = ack_delay
        self._stream_window = stream_window
        self._connection_window = connection_window
        self._consumed: dict[int, int] = {}
        # Bytes delivered to the application's stream buffers and not read yet.
        self.app_unread = 0

    def _parse_transport_parameters(self, data: bytes, from_session_ticket: bool = False) -> None:
        super()._parse_transport_parameters(data, from_session_ticket)
        if self._peer_max_ack_delay is not None:
            # aioquic advertises 25 ms whatever its ACK timer does (QuicConfig.peer_max_ack_delay).
            self._loss.max_ack_delay = min(self._loss.max_ack_delay, self._peer_max_ack_delay)

    # -- mutual authentication ------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def peer_public_key(self) -> bytes | None:
        """The raw Ed25519 key of the peer's certificate, or ``None`` (absent / not Ed25519)."""
        certificate = getattr(self.tls, "_peer_certificate", None)
        if certificate is None:
            return None
        return certificate_node_id(certificate)

    # -- streams beyond the peer's stream limit ---------------------------------
    # aioquic writes RESET_STREAM and STOP_SENDING even for a stream still blocked
    # by the peer's MAX_STREAMS, which opens it past the limit: the peer closes the
    # whole connection ("Too many streams open"). Hold those frames until the stream
    # is unblocked; the pending flags stay set, so they go out then.

    def _write_reset_stream_frame(self, builder: Any, stream: Any) -> None:
        if not stream.is_blocked:
            super()._write_reset_stream_frame(builder=builder, stream=stream)

    def _write_stop_sending_frame(self, builder: Any, stream: Any) -> None:
        if not stream.is_blocked:
            super()._write_stop_sending_frame(builder=builder, stream=stream)

    # -- send backlog ---------------------------------------------------------

    def send_backlog(self, stream_id: int) -> int:
        """Bytes written to ``stream_id`` and not yet acknowledged by the peer."""
        sender = self._live_sender(stream_id)
        return 0 if sender is None else sender._buffer_stop - sender._buffer_start

    def send_unsent(self, stream_id: int) -> int:
        """Bytes written to ``stream_id`` and not yet sent once."""
        sender = self._live_sender(stream_id)
        return 0 if sender is None else max(0, sender._buffer_stop - sender.highest_offset)

    def _live_sender(self, stream_id: int) -> Any:
        """The send side of ``stream_id`` while it may still send (not reset), else ``None``."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.sender._reset_error_code is not None:
            return None
        return stream.sender

    # -- application-driven receive credit -------------------------------------

    def note_consumed(self, stream_id: int, nbytes: int) -> bool:
        """The application read ``nbytes`` from ``stream_id``; true when new credit should be sent now."""
        self._consumed[stream_id] = self._consumed.get(stream_id, 0) + nbytes
        self.app_unread -= nbytes
        stream = self._streams.get(stream_id)
        if stream is not None and self._stream_credit_due(stream):
            return True
        return self._connection_credit_due()

    def forget_stream(self, stream_id: int) -> None:
        self._consumed.pop(stream_id, None)

    # Credit updates are batched (a quarter window at a time) while the peer still has
    # credit left; once it is nearly out, every freed byte is granted at once, or a
    # reader waiting on one stream could starve behind streams nobody reads.

    def _stream_credit_due(self, stream: Any) -> bool:
        current = stream.max_stream_data_local
        target = self._consumed.get(stream.stream_id, 0) + self._stream_window
        if not current or target <= current:
            return False
        batch = self._stream_window // 4
        return target - current >= batch or current - stream.receiver.highest_offset < batch

    def _connection_credit_target(self) -> int:
        # `used` counts every byte that arrived; the application has not consumed the
        # bytes in its buffers (app_unread) nor those aioquic still holds out of order.
        undelivered = sum(
            s.receiver.highest_offset - s.receiver.starting_offset() for s in self._streams.values()
        )
        return self._local_max_data.used - self.app_unread - undelivered + self._connection_window

    def _connection_credit_due(self) -> bool:
        limit = self._local_max_data
        batch = self._connection_window // 4
        # Cheap bound first (runs for every packet): the exact target is never above it.
        upper = limit.used - self.app_unread + self._connection_window
        if upper <= limit.value or (upper - limit.value < batch and limit.value - limit.used >= batch):
            return False
        target = self._connection_credit_target()
        if target <= limit.value:
            return False
        return target - limit.value >= batch or limit.value - limit.used < batch

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        limit = self._local_max_data
        if self._connection_credit_due():
            limit.value = self._connection_credit_target()
        # aioquic doubles MAX_DATA when `used` passes half of it; hide `used` so only
        # the application-driven credit above applies.
        used, limit.used = limit.used, 0
        try:
            super()._write_connection_limits(builder=builder, space=space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        if self._stream_credit_due(stream):
            stream.max_stream_data_local = self._consumed.get(stream.stream_id, 0) + self._stream_window
        if stream.max_stream_data_local_sent == stream.max_stream_data_local:
            return  # nothing to announce (the common case, checked for every stream and packet)
        # Same trick for aioquic's per-stream doubling, keyed on highest_offset.
        receiver = stream.receiver
        highest, receiver.highest_offset = receiver.highest_offset, 0
        try:
            super()._write_stream_limits(builder=builder, space=space, stream=stream)
        finally:
            receiver.highest_offset = highest


__all__ = ["MeshQuicConnection", "quic_configuration", "self_signed_certificate"]
