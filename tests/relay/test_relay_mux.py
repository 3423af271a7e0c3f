"""Relay channels (sans-IO): numbering, data, flow control, finish/reset, loss detection."""

from __future__ import annotations

import pytest
from mux_helpers import Mux

from meshnode.relaylink.mux import (
    ChannelData,
    ChannelFinished,
    ChannelOpened,
    ChannelReset,
    CreditGranted,
    LinkClosedByPeer,
    MuxConfig,
    MuxError,
    MuxEvent,
)
from meshnode.wire.mesh_refusal import reset_code
from meshnode.wire.pb import mesh

LOW, HIGH = b"\x01" * 32, b"\x02" * 32


def pair(**config: int) -> tuple[Mux, Mux]:
    return Mux(LOW, HIGH, MuxConfig(**config)), Mux(HIGH, LOW, MuxConfig(**config))


def receive(mux: Mux, channel: int, record: bytes) -> list[MuxEvent]:
    mux.receive_record(channel, record)
    return mux.application_events()


def pump(src: Mux, dst: Mux) -> list[MuxEvent]:
    """Deliver ``src``'s records to ``dst``; what ``dst`` shows its application."""
    for sent in src.records():
        dst.receive_record(sent.channel, sent.record)
    return dst.application_events()


def test_openers_never_collide() -> None:
    low, high = pair()
    assert [low.open_channel() for _ in range(3)] == [2, 4, 6]
    assert [high.open_channel() for _ in range(3)] == [1, 3, 5]


def test_first_data_opens_the_channel_on_the_peer() -> None:
    low, high = pair()
    channel = low.open_channel()
    assert low.write(channel, b"\x01hello") == 6
    assert pump(low, high) == [ChannelOpened(channel), ChannelData(channel, b"\x01hello")]
    assert high.write(channel, b"reply") == 5
    assert pump(high, low) == [ChannelData(channel, b"reply")]


def test_large_writes_are_split_into_chunks_in_order() -> None:
    low, high = pair(max_chunk=1000)
    channel = low.open_channel()
    data = bytes(range(256)) * 20
    assert low.write(channel, data) == len(data)
    records = low.records()
    assert len(records) == 6
    received = b""
    for sent in records:
        for event in receive(high, sent.channel, sent.record):
            if isinstance(event, ChannelData):
                received += event.data
    assert received == data


def test_writer_waits_for_the_reader_stream_window() -> None:
    low, high = pair(stream_window=1000, link_window=10_000)
    channel = low.open_channel()
    assert low.write(channel, b"x" * 500) == 500
    pump(low, high)
    high.consumed(channel, 100)  # the peer still has credit: updates are batched
    assert pump(high, low) == []
    high.consumed(channel, 200)  # a quarter window freed: credit goes out
    assert pump(high, low) == [CreditGranted()]
    assert low.send_credit(channel) == 800
    assert low.write(channel, b"x" * 2000) == 800
    assert low.send_credit(channel) == 0
    pump(low, high)
    high.consumed(channel, 10)  # the writer is out of credit: even a small read is granted
    assert pump(high, low) == [CreditGranted()]
    assert low.send_credit(channel) == 10


def test_link_window_bounds_all_channels_together() -> None:
    low, high = pair(stream_window=1000, link_window=1500)
    a, b = low.open_channel(), low.open_channel()
    assert low.write(a, b"a" * 1000) == 1000
    assert low.write(b, b"b" * 1000) == 500
    pump(low, high)
    high.consumed(a, 1000)
    events = pump(high, low)
    assert CreditGranted() in events
    assert low.send_credit(b) == 500


def test_reader_on_one_channel_is_not_starved_by_an_unread_channel() -> None:
    low, high = pair(stream_window=1000, link_window=1000)
    unread, wanted = low.open_channel(), low.open_channel()
    assert low.write(unread, b"u" * 900) == 900  # nobody ever reads this channel
    assert low.write(wanted, b"w" * 500) == 100
    pump(low, high)
    for _ in range(4):  # the reader of `wanted` takes a little at a time
        high.consumed(wanted, 25)
        pump(high, low)
        assert low.send_credit(wanted) > 0, "link credit was not returned while the peer was nearly out"
        low.write(wanted, b"w" * 25)
        pump(low, high)


def test_finish_and_final_size() -> None:
    low, high = pair()
    channel = low.open_channel()
    low.write(channel, b"abc")
    low.finish(channel)
    assert pump(low, high)[-1] == ChannelFinished(channel)
    with pytest.raises(MuxError, match="write after finish"):
        low.write(channel, b"more")


def test_reset_reaches_the_peer_and_late_data_returns_link_credit() -> None:
    low, high = pair(stream_window=1000, link_window=1000)
    channel = low.open_channel()
    low.write(channel, b"x" * 600)
    pump(low, high)
    high.reset(channel, 0x123)
    low.write(channel, b"y" * 400)  # in flight while the reset travels
    events = pump(high, low)
    assert ChannelReset(channel, 0x123) in events and CreditGranted() in events
    assert pump(low, high) == []  # late data ignored...
    other = low.open_channel()
    # ...and the link credit it used is back: the full window is available again.
    pump(high, low)
    assert low.send_credit(other) == 1000


def test_gap_in_offsets_means_a_lost_frame() -> None:
    low, high = pair()
    channel = low.open_channel()
    low.write(channel, b"first")
    low.records()  # the relay lost it
    low.write(channel, b"second")
    with pytest.raises(MuxError, match="frame lost"):
        pump(low, high)
    # The record opened the channel before its offset gave it away: that opening is withdrawn.
    assert high.application_events() == []


def test_peer_exceeding_the_window_is_a_violation() -> None:
    low, high = pair(stream_window=100)
    channel = low.open_channel()
    low.write(channel, b"x" * 100)
    pump(low, high)
    forged = bytes((0x10,)) + (100).to_bytes(8, "little") + b"y"
    with pytest.raises(MuxError, match="stream window"):
        receive(high, channel, forged)


def test_fin_with_wrong_final_size_is_a_violation() -> None:
    low, high = pair()
    channel = low.open_channel()
    low.write(channel, b"abc")
    pump(low, high)
    with pytest.raises(MuxError, match="final size"):
        receive(high, channel, bytes((0x11,)) + (2).to_bytes(8, "little"))


def test_close_tells_the_peer_once() -> None:
    low, high = pair()
    low.open_channel()
    low.close("node shutting down")
    low.close("again")
    assert pump(low, high) == [LinkClosedByPeer("closed by peer: node shutting down")]
    with pytest.raises(MuxError):
        low.open_channel()
    assert high.closed_reason is not None


def test_too_many_peer_channels_are_reset_with_overloaded() -> None:
    low, high = pair(max_peer_channels=2)
    channels = [low.open_channel() for _ in range(3)]
    for channel in channels:
        low.write(channel, b"\x01")
    events = pump(low, high)
    assert [e for e in events if isinstance(e, ChannelOpened)] == [ChannelOpened(2), ChannelOpened(4)]
    assert pump(high, low) == [ChannelReset(6, reset_code(mesh.MESH_ERROR_OVERLOADED))]


def test_records_for_unknown_or_stale_channels_are_ignored() -> None:
    low, high = pair()
    channel = low.open_channel()
    low.write(channel, b"x")
    low.finish(channel)
    pump(low, high)
    high.consumed(channel, 1)
    high.finish(channel)
    pump(high, low)
    assert low.open_channels == high.open_channels == 0
    # A replayed opening record cannot reopen a finished channel.
    assert receive(high, channel, bytes((0x10,)) + (0).to_bytes(8, "little") + b"x") == []


def test_malformed_records_are_violations() -> None:
    _low, high = pair()
    with pytest.raises(MuxError):
        receive(high, 2, b"")
    with pytest.raises(MuxError):
        receive(high, 2, b"\x77" + b"\0" * 8)
    with pytest.raises(MuxError):
        receive(high, 0, b"\x10")


def test_stop_reading_returns_credit_for_unread_and_later_data() -> None:
    low, high = pair(stream_window=1000, link_window=1000)
    channel = low.open_channel()
    assert low.write(channel, b"x" * 1000) == 1000
    pump(low, high)
    high.stop_reading(channel)  # nobody will read the 1000 bytes
    assert CreditGranted() in pump(high, low)
    assert low.send_credit(channel) == 1000
    low.write(channel, b"y" * 1000)
    assert pump(low, high) == []  # discarded on arrival, not delivered...
    assert CreditGranted() in pump(high, low)  # ...and the credit comes straight back
    assert low.send_credit(channel) == 1000
