"""A relayed link's channels take turns (at the sending node and at the relay), and nothing the
receiver relies on is reordered: a channel's records, channels' first records, the control channel."""

from __future__ import annotations

import random

import pytest
from helpers.mesh_nodes import start_relay_server
from hypothesis import given, settings
from hypothesis import strategies as st
from mux_helpers import Mux
from relay_helpers import EchoHandler, new_member, registered_links
from seal_helpers import handshake, pair, receive

from meshnode.membership.credentials import MeshKey
from meshnode.relaylink.link import RelayedPeerLink
from meshnode.relaylink.mux import ChannelData, ChannelFinished, MuxConfig
from meshnode.relaylink.seal import REPLAY_WINDOW, Opened
from meshnode.relaylink.send_turns import OutgoingRecord, Sealer, SendTurns
from meshnode.relaywire.channel_turns import CONTROL_CHANNEL, ChannelTurns
from meshnode.transport.base import PeerLink
from meshnode.wire.framing import StreamType
from relay.fair_queue import MAX_OVERTAKEN, FairQueue

LOW, HIGH = b"\x01" * 32, b"\x02" * 32


def drain(turns: ChannelTurns[str]) -> list[str]:
    out = []
    while turns:
        head = turns.peek()
        out.append(turns.pop())
        assert out[-1] == head
    return out


def test_a_busy_channel_is_passed_by_one_queued_after_it_and_keeps_its_own_order() -> None:
    turns: ChannelTurns[str] = ChannelTurns()
    for i in range(4):
        turns.push(2, f"bulk{i}")
    turns.push(4, "step")
    turns.push(2, "bulk4")
    assert drain(turns) == ["bulk0", "step", "bulk1", "bulk2", "bulk3", "bulk4"]
    assert len(turns) == 0


def test_channels_first_records_leave_in_the_order_they_were_queued() -> None:
    turns: ChannelTurns[str] = ChannelTurns()
    for record in ("a2", "a4", "b2", "c2", "a6", "b4"):
        turns.push(int(record[1]), record)
    out = drain(turns)
    firsts = [next(r for r in out if r[1] == c) for c in "246"]
    assert firsts == ["a2", "a4", "a6"]
    assert out == ["a2", "a4", "a6", "b2", "b4", "c2"]


def test_a_control_record_is_a_barrier_both_ways() -> None:
    turns: ChannelTurns[str] = ChannelTurns()
    turns.push(2, "before0")
    turns.push(2, "before1")
    turns.push(CONTROL_CHANNEL, "control")
    turns.push(4, "after")
    assert drain(turns) == ["before0", "before1", "control", "after"]


def test_overtaking_is_bounded() -> None:
    turns: ChannelTurns[int] = ChannelTurns(max_overtaken=3)
    for i in range(10):
        turns.push(2, i)
    turns.push(4, 10)
    # Blocks of four: the step passes at most three records queued before it.
    assert drain(turns) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 9]
    with pytest.raises(ValueError):
        ChannelTurns(max_overtaken=0)


def test_the_client_takes_turns_between_destinations_and_seals_as_records_leave() -> None:
    sealed: list[tuple[int, bytes]] = []

    def seal(channel: int, record: bytes) -> bytes:
        sealed.append((channel, record))
        return b"sealed:" + record

    turns = SendTurns()
    for i in range(3):
        turns.push(b"B", OutgoingRecord(2, b"b%d" % i, seal))
    turns.push(b"C", OutgoingRecord(CONTROL_CHANNEL, b"hello"))
    turns.push(b"B", OutgoingRecord(4, b"step", seal))
    out = []
    while (item := turns.pop()) is not None:
        out.append((item[0], item[1].payload()))
    assert out == [
        (b"B", b"sealed:b0"),
        (b"C", b"hello"),  # a handshake message goes as it is
        (b"B", b"sealed:step"),
        (b"B", b"sealed:b1"),
        (b"B", b"sealed:b2"),
    ]
    assert [record for _, record in sealed] == [b"b0", b"step", b"b1", b"b2"]  # in the order on the wire
    assert len(turns) == 0


def test_the_relay_lets_a_sources_channels_take_turns_within_the_replay_window() -> None:
    for queued_before in (10, 3 * MAX_OVERTAKEN):
        queue = FairQueue(quantum_bytes=1 << 20)
        for i in range(queued_before):
            queue.push(b"A", b"bulk%d" % i, 2)
        queue.push(b"A", b"step", 4)
        queue.push(b"B", b"other", 2)
        order = []
        while (item := queue.pop()) is not None:
            order.append(item)
        frames_of_a = [frame for source, frame in order if source == b"A"]
        passed = queued_before - frames_of_a.index(b"step")
        # It passed frames queued before it, never more than the receiver's replay window allows.
        assert 0 < passed <= MAX_OVERTAKEN, passed
        assert [f for f in frames_of_a if f != b"step"] == [b"bulk%d" % i for i in range(queued_before)]
        assert queue.nbytes == 0 and len(queue) == 0
    assert MAX_OVERTAKEN < REPLAY_WINDOW


def test_frames_a_node_sealed_in_order_still_open_after_the_relays_turns() -> None:
    """A node of the previous version seals in the order it queues; the relay's turns reorder
    its frames, and every one must still open at the receiver (no replay-window drop)."""
    a, b = pair()
    handshake(a, b)
    queue = FairQueue(quantum_bytes=1 << 20)
    sent, channel_of = [], {}
    for i in range(3 * MAX_OVERTAKEN):
        channel = 2 if i % 50 else 4 + 2 * (i // 50)  # a transfer, and a step now and then
        frame = a.seal(channel, b"%d" % i)
        sent.append((channel, b"%d" % i))
        channel_of[frame] = channel
        queue.push(b"A", frame, channel)
    received = []
    while (item := queue.pop()) is not None:
        channel = channel_of[item[1]]
        (event,) = receive(b, channel, item[1])
        assert isinstance(event, Opened), event
        received.append((channel, event.plaintext))
    assert received != sent  # the steps overtook
    assert sorted(received) == sorted(sent)


async def test_a_link_that_ended_sends_no_more_of_its_channels_records_but_its_close() -> None:
    """Records of a link that ended while they waited would be dropped unread by the peer and,
    on a slow path, hold back a new link's handshake: only its control records still go."""
    a, b = pair()
    handshake(a, b)
    assert a.current is not None
    queued: list[tuple[int, bytes, Sealer]] = []
    link = RelayedPeerLink(
        session=a.current,
        send=lambda channel, record, seal: queued.append((channel, record, seal)),
        handler=EchoHandler(),
        relay_id=b"\x09" * 32,
        relay_description="test",
    )
    stream = await link.open_stream(StreamType.PROBE)
    await stream.send_frame(bytes(40_000))
    channel, record, seal = queued.pop(0)
    sealed = seal(channel, record)  # left while the link was up: it goes
    assert sealed is not None
    (event,) = receive(b, channel, sealed)
    assert isinstance(event, Opened) and event.plaintext == record
    link.close("leaving")
    left = [(channel, seal(channel, record)) for channel, record, seal in queued]
    assert len(left) > 2
    assert [channel for channel, payload in left if payload is not None] == [CONTROL_CHANNEL]
    close = next(payload for channel, payload in left if payload is not None)
    (event,) = receive(b, CONTROL_CHANNEL, close)
    assert isinstance(event, Opened) and b"leaving" in event.plaintext


# -- against the real receiver: records reordered by the turns never break the channel protocol --


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_overtaken=st.sampled_from([None, 1, 3, 50]))
def test_the_receiving_mux_takes_whatever_order_the_turns_give(seed: int, max_overtaken: int | None) -> None:
    rng = random.Random(seed)
    config = MuxConfig(stream_window=4096, link_window=12288, max_chunk=700)
    sender, receiver = Mux(LOW, HIGH, config), Mux(HIGH, LOW, config)
    turns: ChannelTurns[tuple[int, bytes]] = ChannelTurns(max_overtaken)
    written: dict[int, bytearray] = {}
    finished: set[int] = set()
    received: dict[int, bytearray] = {}
    ended: set[int] = set()

    def queue_what_the_sender_made() -> None:
        for record in sender.records():
            turns.push(record.channel, (record.channel, record.record))

    def deliver(count: int) -> None:
        for _ in range(min(count, len(turns))):
            channel, record = turns.pop()
            receiver.receive_record(channel, record)
        for event in receiver.application_events():
            if isinstance(event, ChannelData):
                received.setdefault(event.channel, bytearray()).extend(event.data)
                receiver.consumed(event.channel, len(event.data))
            elif isinstance(event, ChannelFinished):
                ended.add(event.channel)
        # Credit goes back in order (the sender's side of the link is not under test here).
        for record in receiver.records():
            sender.receive_record(record.channel, record.record)
        sender.application_events()

    for _ in range(rng.randint(20, 120)):
        action = rng.random()
        open_channels = [c for c in written if c not in finished]
        if action < 0.15 or not open_channels:
            # As a stream opens: its type byte is written at once (a channel that could not
            # write it, the link's credit spent, is not used again).
            channel = sender.open_channel()
            if sender.write(channel, b"\x07"):
                written[channel] = bytearray(b"\x07")
        elif action < 0.65:
            channel = rng.choice(open_channels)
            data = rng.randbytes(rng.randint(1, 3000))
            taken = sender.write(channel, data)
            written[channel].extend(data[:taken])
        elif action < 0.72:
            channel = rng.choice(open_channels)
            sender.finish(channel)
            finished.add(channel)
        else:
            queue_what_the_sender_made()
            deliver(rng.randint(1, 8))
        queue_what_the_sender_made()
    while turns:
        deliver(len(turns))
    deliver(0)
    for channel, data in written.items():
        assert received.get(channel, bytearray()) == data, channel
    assert ended == finished


# -- over real QUIC and a real relay --------------------------------------------------------


class RecordingHandler(EchoHandler):
    """Echoes, and records the (channel, size) of every record its links receive, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[tuple[int, int]] = []

    def link_established(self, link: PeerLink) -> None:
        super().link_established(link)
        received = link.record_received  # type: ignore[attr-defined]  # a relayed link's, wrapped below

        def recording(channel: int, record: bytes) -> None:
            self.arrivals.append((channel, len(record)))
            received(channel, record)

        link.record_received = recording  # type: ignore[attr-defined]  # recorded in place


@pytest.mark.timeout(60)
async def test_a_step_written_after_a_transfer_reaches_the_peer_before_most_of_it() -> None:
    mesh_key = MeshKey.generate()
    server, endpoint = await start_relay_server(mesh_key)
    a, b = new_member(mesh_key), new_member(mesh_key)
    handler_b = RecordingHandler()
    la = await registered_links(a, endpoint, EchoHandler())
    lb = await registered_links(b, endpoint, handler_b)
    try:
        link = await la.open_link(b.node_id)
        transfer = await link.open_stream(StreamType.PROBE)
        step = await link.open_stream(StreamType.PROBE)
        big = bytes(900_000)  # within a channel's window: all of it is queued at once
        await transfer.send_frame(big)
        await step.send_frame(b"step")
        assert await step.recv_frame(20) == b"step"
        assert await transfer.recv_frame(20) == big
        transfer_channel, step_channel = transfer.stream.stream_id, step.stream.stream_id
        # The step channel's records: its type byte (written when it opened), then the step.
        step_arrivals = [i for i, (channel, _) in enumerate(handler_b.arrivals) if channel == step_channel]
        assert len(step_arrivals) == 2, handler_b.arrivals
        transfer_before_step = sum(
            size for channel, size in handler_b.arrivals[: step_arrivals[1]] if channel == transfer_channel
        )
        # Queued in one FIFO, all 900 kB came first; taking turns, the step passed nearly all of it.
        assert transfer_before_step < len(big) // 3, transfer_before_step
        assert la.frames_dropped == lb.frames_dropped == 0
    finally:
        await la.close()
        await lb.close()
        await server.close(flush_timeout=0.3)
