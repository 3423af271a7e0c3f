"""A relayed :class:`PeerLink`: channels over one sealed session through one relay.

The link owns a :class:`~meshnode.relaylink.mux.ChannelMux` (channel state and
flow control) and a sealed session; every outgoing record is handed to the relay
client, which seals it with the channel number bound in when it leaves (the
channels take turns there, :mod:`meshnode.relaylink.send_turns`). Streams behave like the
QUIC and loopback ones: ``write`` waits for credit the peer grants as its
application reads, ``read`` returns ``b""`` at the end and raises
:class:`StreamReset` with the peer's code after a reset, and the link's owner
(the node) serves accepted channels with the same dispatcher as QUIC streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from meshnode.identity import short_id
from meshnode.relaylink.mux import (
    CONTROL_CHANNEL,
    ChannelData,
    ChannelFinished,
    ChannelMux,
    ChannelOpened,
    ChannelReset,
    CreditGranted,
    LinkClosedByPeer,
    MuxConfig,
    MuxError,
    MuxEvent,
    SendRecord,
)
from meshnode.relaylink.seal import SealedSession, SealError
from meshnode.relaylink.send_turns import Sealer
from meshnode.transport.base import LinkClosed, LinkHandler, MeshStream, PeerLink, StreamError, StreamReset
from meshnode.transport.buffers import Progress, ReceiveBuffer
from meshnode.transport.credited_stream import CreditedStream
from meshnode.transport.read_limits import ReadLimits

log = logging.getLogger(__name__)

# Queues one record for the peer through the relay, with what seals it when it leaves
# (non-blocking, may raise LinkClosed).
SendRecordTo = Callable[[int, bytes, Sealer], None]


class RelayChannelStream(CreditedStream):
    _link: RelayedPeerLink

    def __init__(self, link: RelayedPeerLink, channel: int) -> None:
        self._link = link
        self._channel = channel
        self.peer_id = link.peer_id
        self.read_limits = link.read_limits
        self.recv = ReceiveBuffer()
        self.send_error: Exception | None = None

    @property
    def stream_id(self) -> int:
        return self._channel

    async def read(self, max_bytes: int = 65536) -> bytes:
        data = await self.recv.read(max_bytes)
        if data:
            self._link.consumed(self._channel, len(data))
        return data

    def _send_credit(self) -> int:
        return self._link.mux.send_credit(self._channel)

    def _send_piece(self, piece: memoryview) -> None:
        self._link.mux.write(self._channel, piece)
        self._link.flush()
        # A piece the relay could not take closed the link: it fails this write.
        self._check_writable()

    def finish(self) -> None:
        if self.send_error is not None or self._link.is_closed:
            return
        self.send_error = StreamError("write after finish")
        self._link.mux.finish(self._channel)
        self._link.sweep(self._channel)
        self._link.flush()

    def close(self) -> None:
        """Finish, and discard whatever the peer still sends (its credit is returned)."""
        self.finish()
        link = self._link
        if link.is_closed:
            return
        self.recv.fail(StreamError("stream closed"))
        link.mux.stop_reading(self._channel)
        link.sweep(self._channel)
        link.flush()

    def reset(self, error_code: int) -> None:
        link = self._link
        if link.is_closed:
            return
        link.mux.reset(self._channel, error_code)
        self.abort(StreamReset(error_code, by_peer=False))
        link.forget(self._channel)
        link.flush()

    def abort(self, error: Exception) -> None:
        if self.send_error is None or not isinstance(self.send_error, StreamReset):
            self.send_error = error
        self.recv.fail(error)


class RelayedPeerLink(PeerLink):
    def __init__(
        self,
        *,
        session: SealedSession,
        send: SendRecordTo,
        handler: LinkHandler,
        relay_id: bytes,
        relay_description: str,
        mux_config: MuxConfig | None = None,
        on_closed: Callable[[RelayedPeerLink], None] | None = None,
    ) -> None:
        self.session = session
        self.peer_id = session.peer_id
        self.initiated_locally = session.initiated_locally
        self.relay_id = relay_id
        self.established_at = asyncio.get_running_loop().time()
        self.mux = ChannelMux(session.local_id, session.peer_id, mux_config or MuxConfig())
        self.progress = Progress()
        # A relayed peer is capped like a QUIC one, against the same process budget.
        self.read_limits = ReadLimits.for_connection()
        self.close_reason = ""
        self._send = send
        self._handler = handler
        self._relay_description = relay_description
        self._on_closed = on_closed
        self._streams: dict[int, RelayChannelStream] = {}
        self._closed = asyncio.Event()
        self._flushing = False

    # -- PeerLink ---------------------------------------------------------------------

    async def open_raw_stream(self) -> MeshStream:
        if self.is_closed:
            raise LinkClosed(self.close_reason)
        channel = self.mux.open_channel()
        stream = RelayChannelStream(self, channel)
        self._streams[channel] = stream
        return stream

    def close(self, reason: str = "") -> None:
        if self.is_closed:
            return
        self.mux.close(reason or "closed")
        self.flush()
        self.terminate(reason or "closed")

    @property
    def description(self) -> str:
        return f"relay {self._relay_description}"

    @property
    def stream_count(self) -> int:
        """Channels the link still tracks, as a QUIC link's streams: one is forgotten once it is
        done both ways (finished each way and read to the end) or reset. Counted, a relayed link
        outside the active view is closed once idle like a direct one (delta gossip)."""
        return self.mux.open_channels

    # -- driven by the relay-link manager ------------------------------------------------------

    def record_received(self, channel: int, record: bytes) -> None:
        """An opened record from the peer."""
        if self.is_closed:
            return
        self.last_heard_at = asyncio.get_running_loop().time()
        try:
            self.mux.receive_record(channel, record)
        except MuxError as exc:
            log.info("relayed link to %s broke the channel protocol: %s", short_id(self.peer_id), exc)
            self.close(f"channel protocol violation: {exc}")
            return
        self.flush()

    def terminate(self, reason: str) -> None:
        """The link is gone (closed here, by the peer, or its relay/session went away)."""
        if self.is_closed:
            return
        self.close_reason = reason
        self._closed.set()
        for stream in self._streams.values():
            stream.abort(LinkClosed(reason))
        self._streams.clear()
        self.progress.notify()
        if self._on_closed is not None:
            self._on_closed(self)
        self._handler.link_closed(self, reason)

    # -- used by streams ------------------------------------------------------------------

    def consumed(self, channel: int, nbytes: int) -> None:
        if self.is_closed:
            return
        self.mux.consumed(channel, nbytes)
        self.sweep(channel)
        self.flush()

    def forget(self, channel: int) -> None:
        self._streams.pop(channel, None)

    def sweep(self, channel: int) -> None:
        """Drop our reference once the channel is done both ways (its user may still hold it)."""
        if not self.mux.is_open(channel):
            self._streams.pop(channel, None)

    def flush(self) -> None:
        """Carry out what the mux produced, in order: seal and send its records, hand the
        application its data, new channels, ends and resets."""
        if self._flushing:
            # Called back from a handler (a stream accepted, then reset at once): the loop
            # below takes what that produced after what came before it, in order.
            return
        self._flushing = True
        try:
            while events := self.mux.take_events():
                for event in events:
                    if not self._carry_out(event):
                        return
        finally:
            self._flushing = False

    def _seal(self, channel: int, record: bytes) -> bytes | None:
        """A record sealed as it leaves; ``None`` when it is not to be sent.

        Not a data channel's record of a link that ended while it waited: its peer would drop
        it unread (the session is gone there too), and on a slow path it would hold back what
        comes after it for that peer, a new link's handshake first (as a closed QUIC connection
        sends no more stream data). The control channel's (CLOSE, link credit) still go. The
        link ends when the session cannot seal."""
        if self.is_closed and channel != CONTROL_CHANNEL:
            return None
        try:
            return self.session.seal(channel, record)
        except SealError as exc:
            self.terminate(f"relay send failed: {exc}")
            return None

    def _carry_out(self, event: MuxEvent) -> bool:
        """False once nothing more can be done (the relay send failed, or the peer closed)."""
        if isinstance(event, SendRecord):
            try:
                self._send(event.channel, event.record, self._seal)
            except StreamError as exc:
                self.terminate(f"relay send failed: {exc}")
                return False
        elif self.is_closed:
            # A handler closed the link mid-batch: its records (the CLOSE) still go out, but no
            # stream may be accepted or fed on a link that is gone.
            pass
        elif isinstance(event, ChannelData):
            stream = self._streams.get(event.channel)
            if stream is not None:
                stream.recv.feed(event.data)
        elif isinstance(event, ChannelOpened):
            stream = RelayChannelStream(self, event.channel)
            self._streams[event.channel] = stream
            self.streams_accepted += 1
            self._handler.stream_accepted(self, stream)
        elif isinstance(event, ChannelFinished):
            stream = self._streams.get(event.channel)
            if stream is not None:
                stream.recv.feed_eof()
                self.sweep(event.channel)
        elif isinstance(event, ChannelReset):
            stream = self._streams.pop(event.channel, None)
            if stream is not None:
                stream.abort(StreamReset(event.error_code))
            self.progress.notify()
        elif isinstance(event, CreditGranted):
            self.progress.notify()
        elif isinstance(event, LinkClosedByPeer):
            self.terminate(event.reason)
            return False
        return True


__all__ = ["RelayChannelStream", "RelayedPeerLink", "SendRecordTo"]
