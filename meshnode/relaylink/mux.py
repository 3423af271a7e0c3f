"""Relay channels: virtual bidirectional streams between two nodes. Sans-IO.

A channel is ``(peer, channel number)``. The opener allocates the number: the
node whose id sorts lower uses even numbers from 2, the other odd numbers from 1
(like QUIC stream ids), so two openers never collide; channel 0 is the link's
control channel. Numbers are never reused.

Everything here travels *inside* sealed payloads (the relay only sees the
channel number), one record per payload::

    DATA             [0x10][offset u64][bytes]      channel >= 1
    FIN              [0x11][final size u64]         channel >= 1
    RESET            [0x12][error code u64]         channel >= 1; aborts both directions
    MAX_STREAM_DATA  [0x13][limit u64]              channel >= 1; receive credit
    MAX_DATA         [0x20][limit u64]              channel 0; link-wide receive credit
    CLOSE            [0x21][reason UTF-8]           channel 0; the link is gone

Flow control is QUIC's: a sender may have sent at most ``limit`` bytes on a
channel (MAX_STREAM_DATA) and on the link (MAX_DATA); the receiver raises the
limits only as its application reads, so unread data is bounded by the windows
and a writer waits (the same backpressure as the QUIC and loopback streams).
The relay keeps one sender's frames in order, so offsets must be contiguous: a
gap means a relayed frame was lost and the link is closed.

In the convention of :mod:`meshnode.sansio`: the peer's records go in with
``receive_record``, local commands (``write``, ``finish``, ``reset``, ...) change the
state, and everything for the link to do — records to seal and send
(:class:`SendRecord`) and what the application should see — comes out of
``take_events()``, in order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from meshnode.wire.errors import MeshnodeError
from meshnode.wire.mesh_refusal import reset_code
from meshnode.wire.pb import mesh

REC_DATA, REC_FIN, REC_RESET, REC_MAX_STREAM_DATA = 0x10, 0x11, 0x12, 0x13
REC_MAX_DATA, REC_CLOSE = 0x20, 0x21
CONTROL_CHANNEL = 0
MAX_CLOSE_REASON = 200

_U64 = struct.Struct("<BQ")
_HEADER = _U64.size

DEFAULT_STREAM_WINDOW = 1024 * 1024
DEFAULT_LINK_WINDOW = 4 * 1024 * 1024
# A record's data at most: the channels of a link take turns a record each (send_turns), so
# this is what one turn of a transfer costs the link's other channels on the wire.
DEFAULT_MAX_CHUNK = 16 * 1024
DEFAULT_MAX_PEER_CHANNELS = 512


class MuxError(MeshnodeError):
    """The peer broke the channel protocol; the link must close with this reason."""


# -- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendRecord:
    """Seal ``record`` for ``channel`` and send it to the peer."""

    channel: int
    record: bytes


@dataclass(frozen=True)
class ChannelOpened:
    channel: int


@dataclass(frozen=True)
class ChannelData:
    channel: int
    data: bytes


@dataclass(frozen=True)
class ChannelFinished:
    channel: int


@dataclass(frozen=True)
class ChannelReset:
    channel: int
    error_code: int


@dataclass(frozen=True)
class CreditGranted:
    """Send credit grew: waiting writers should retry."""


@dataclass(frozen=True)
class LinkClosedByPeer:
    reason: str


MuxEvent = (
    SendRecord
    | ChannelOpened
    | ChannelData
    | ChannelFinished
    | ChannelReset
    | CreditGranted
    | LinkClosedByPeer
)


@dataclass
class _Channel:
    number: int
    send_limit: int
    recv_limit: int
    sent: int = 0
    fin_sent: bool = False
    received: int = 0
    consumed: int = 0
    fin_received: bool = False
    reset: bool = False
    # The application stopped reading: data is consumed on arrival, credit returned.
    discarding: bool = False


@dataclass
class MuxConfig:
    stream_window: int = DEFAULT_STREAM_WINDOW
    link_window: int = DEFAULT_LINK_WINDOW
    max_chunk: int = DEFAULT_MAX_CHUNK
    max_peer_channels: int = DEFAULT_MAX_PEER_CHANNELS


@dataclass
class ChannelMux:
    """Channel state for one relayed link; what it produces waits in ``take_events()``."""

    local_id: bytes
    peer_id: bytes
    config: MuxConfig = field(default_factory=MuxConfig)

    def __post_init__(self) -> None:
        lower = self.local_id < self.peer_id
        self._next_local = 2 if lower else 1
        self._peer_parity = 1 if lower else 0
        self._highest_peer = 0
        self._channels: dict[int, _Channel] = {}
        self._events: list[MuxEvent] = []
        window = self.config.link_window
        self._link_send_limit = window
        self._link_sent = 0
        self._link_recv_limit = window
        self._link_received = 0
        self._link_consumed = 0
        self.closed_reason: str | None = None

    # -- local actions -----------------------------------------------------------------

    def open_channel(self) -> int:
        self._check_open()
        number = self._next_local
        self._next_local += 2
        window = self.config.stream_window
        self._channels[number] = _Channel(number=number, send_limit=window, recv_limit=window)
        return number

    def send_credit(self, channel: int) -> int:
        """Bytes ``write`` would take now (0 while waiting for the peer to read)."""
        state = self._channels.get(channel)
        if state is None or state.fin_sent or state.reset or self.closed_reason is not None:
            return 0
        return max(0, min(state.send_limit - state.sent, self._link_send_limit - self._link_sent))

    def write(self, channel: int, data: bytes | memoryview) -> int:
        """Queue up to the available credit of ``data``; returns how many bytes were taken."""
        state = self._writable(channel)
        take = min(len(data), self.send_credit(channel))
        view = memoryview(data)[:take]
        chunk = self.config.max_chunk
        for start in range(0, take, chunk):
            piece = view[start : start + chunk]
            self._events.append(SendRecord(channel, _U64.pack(REC_DATA, state.sent) + piece))
            state.sent += len(piece)
        self._link_sent += take
        return take

    def finish(self, channel: int) -> None:
        state = self._channels.get(channel)
        if state is None or state.fin_sent or state.reset:
            return
        state.fin_sent = True
        self._events.append(SendRecord(channel, _U64.pack(REC_FIN, state.sent)))
        self._maybe_forget(state)

    def reset(self, channel: int, error_code: int) -> None:
        state = self._channels.pop(channel, None)
        if state is None or state.reset:
            return
        state.reset = True
        self._release_unread(state)
        if self.closed_reason is None:
            self._events.append(SendRecord(channel, _U64.pack(REC_RESET, error_code)))

    def consumed(self, channel: int, nbytes: int) -> None:
        """The application read ``nbytes`` from ``channel``: grant more credit when due."""
        self._link_consumed += nbytes
        state = self._channels.get(channel)
        if state is not None:
            state.consumed += nbytes
            self._grant_stream(state)
            self._maybe_forget(state)
        self._grant_link()

    def stop_reading(self, channel: int) -> None:
        """The application is done reading ``channel``: drop what is unread and whatever still arrives."""
        state = self._channels.get(channel)
        if state is None or state.discarding:
            return
        state.discarding = True
        self._release_unread(state)
        self._grant_stream(state)
        self._maybe_forget(state)

    def close(self, reason: str) -> None:
        """Close the link: tell the peer once; every channel is gone."""
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        self._channels.clear()
        self._events.append(
            SendRecord(CONTROL_CHANNEL, bytes((REC_CLOSE,)) + reason.encode()[:MAX_CLOSE_REASON])
        )

    def take_events(self) -> list[MuxEvent]:
        """Everything since the last call, in order: records to send and what the application sees."""
        events, self._events = self._events, []
        return events

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def is_open(self, channel: int) -> bool:
        return channel in self._channels

    # -- peer records ---------------------------------------------------------------------

    def receive_record(self, channel: int, record: bytes) -> None:
        """Apply one opened record from the peer. Raises :class:`MuxError` on a violation; a
        record that breaks the protocol produces no events (the link is closed for it)."""
        if self.closed_reason is not None:
            return
        produced_before = len(self._events)
        try:
            self._receive_record(channel, record)
        except MuxError:
            # E.g. a channel it opened before its data proved out of order: nobody may accept it.
            del self._events[produced_before:]
            raise

    def _receive_record(self, channel: int, record: bytes) -> None:
        if not record:
            raise MuxError("empty channel record")
        kind = record[0]
        if channel == CONTROL_CHANNEL:
            self._receive_control(kind, record)
            return
        if kind == REC_DATA:
            self._receive_data(channel, record)
            return
        if kind not in (REC_FIN, REC_RESET, REC_MAX_STREAM_DATA) or len(record) != _HEADER:
            raise MuxError(f"bad channel record 0x{kind:02x}")
        _, value = _U64.unpack(record)
        if kind == REC_MAX_STREAM_DATA:
            state = self._channels.get(channel)
            if state is not None and value > state.send_limit:
                state.send_limit = value
                self._events.append(CreditGranted())
            return
        state = self._channel_for(channel)
        if state is None:
            return
        if kind == REC_RESET:
            del self._channels[channel]
            state.reset = True
            self._release_unread(state)
            self._events.append(ChannelReset(channel, value))
            return
        if value != state.received or state.fin_received:
            raise MuxError(f"channel {channel}: final size {value} does not match {state.received} received")
        state.fin_received = True
        self._maybe_forget(state)
        self._events.append(ChannelFinished(channel))

    def _receive_control(self, kind: int, record: bytes) -> None:
        if kind == REC_CLOSE:
            reason = record[1:].decode("utf-8", "replace")
            self.closed_reason = f"closed by peer: {reason}" if reason else "closed by peer"
            self._channels.clear()
            self._events.append(LinkClosedByPeer(self.closed_reason))
            return
        if kind == REC_MAX_DATA and len(record) == _HEADER:
            _, value = _U64.unpack(record)
            if value > self._link_send_limit:
                self._link_send_limit = value
                self._events.append(CreditGranted())
            return
        raise MuxError(f"bad control record 0x{kind:02x}")

    def _receive_data(self, channel: int, record: bytes) -> None:
        if len(record) < _HEADER:
            raise MuxError("truncated data record")
        (offset,) = struct.unpack_from("<Q", record, 1)
        state = self._channel_for(channel)
        data = record[_HEADER:]
        if state is None:
            # Late data for a channel already reset: it still used link credit; give it back.
            self._link_received += len(data)
            self._link_consumed += len(data)
            self._grant_link()
            return
        if state.fin_received:
            raise MuxError(f"channel {channel}: data after FIN")
        if offset != state.received:
            raise MuxError(
                f"channel {channel}: data at offset {offset}, expected {state.received} (frame lost)"
            )
        end = offset + len(data)
        if end > state.recv_limit:
            raise MuxError(f"channel {channel}: peer exceeded the stream window")
        if self._link_received + len(data) > self._link_recv_limit:
            raise MuxError("peer exceeded the link window")
        state.received = end
        self._link_received += len(data)
        if state.discarding:
            self._release_unread(state)
            self._grant_stream(state)
        elif data:
            self._events.append(ChannelData(channel, data))

    def _channel_for(self, channel: int) -> _Channel | None:
        """The channel a peer record is for, opened (a ChannelOpened event) if it is new."""
        state = self._channels.get(channel)
        if state is not None:
            return state
        if channel & 1 != self._peer_parity or channel <= self._highest_peer:
            return None  # ours, or the peer's and already finished with
        if channel - self._highest_peer > 2 * self.config.max_peer_channels:
            raise MuxError(f"channel number {channel} jumps too far")
        self._highest_peer = channel
        window = self.config.stream_window
        state = _Channel(number=channel, send_limit=window, recv_limit=window)
        self._channels[channel] = state
        if sum(1 for n in self._channels if n & 1 == self._peer_parity) > self.config.max_peer_channels:
            # Too many open channels from the peer: refuse this one, keep the link.
            self.reset(channel, reset_code(mesh.MESH_ERROR_OVERLOADED))
            return None
        self._events.append(ChannelOpened(channel))
        return state

    # -- helpers ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed_reason is not None:
            raise MuxError(self.closed_reason)

    def _writable(self, channel: int) -> _Channel:
        self._check_open()
        state = self._channels.get(channel)
        if state is None or state.reset:
            raise MuxError(f"channel {channel} is closed")
        if state.fin_sent:
            raise MuxError(f"channel {channel}: write after finish")
        return state

    # Credit goes out a quarter window at a time while the peer still has credit left;
    # once it is nearly out, every freed byte is granted at once, or a reader waiting on
    # one channel could starve behind channels nobody reads.

    def _grant_stream(self, state: _Channel) -> None:
        if state.fin_received or state.reset:
            return
        window = self.config.stream_window
        target = state.consumed + window
        if target <= state.recv_limit:
            return
        batch = window // 4
        if target - state.recv_limit >= batch or state.recv_limit - state.received < batch:
            state.recv_limit = target
            self._events.append(SendRecord(state.number, _U64.pack(REC_MAX_STREAM_DATA, target)))

    def _grant_link(self) -> None:
        if self.closed_reason is not None:
            return
        window = self.config.link_window
        target = self._link_consumed + window
        limit = self._link_recv_limit
        if target <= limit:
            return
        batch = window // 4
        if target - limit >= batch or limit - self._link_received < batch:
            self._link_recv_limit = target
            self._events.append(SendRecord(CONTROL_CHANNEL, _U64.pack(REC_MAX_DATA, target)))

    def _release_unread(self, state: _Channel) -> None:
        # Bytes received but never read still count against the link window; give them back.
        unread = state.received - state.consumed
        if unread > 0:
            self._link_consumed += unread
            state.consumed = state.received
            self._grant_link()

    def _maybe_forget(self, state: _Channel) -> None:
        if state.fin_sent and state.fin_received and state.consumed >= state.received:
            self._channels.pop(state.number, None)


__all__ = [
    "CONTROL_CHANNEL",
    "ChannelData",
    "ChannelFinished",
    "ChannelMux",
    "ChannelOpened",
    "ChannelReset",
    "CreditGranted",
    "LinkClosedByPeer",
    "MuxConfig",
    "MuxError",
    "MuxEvent",
    "SendRecord",
]
