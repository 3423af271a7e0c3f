"""QUIC transport: mutual Ed25519 authentication, pinning, backpressure, keepalive.

These also pin the aioquic internals meshnode.transport.quic_connection relies on:
an aioquic upgrade that breaks client-certificate requests or receive credit fails here.
"""

import asyncio
import dataclasses
import hashlib
import ssl

import pytest
from aioquic.asyncio import connect
from aioquic.quic.configuration import QuicConfiguration
from helpers.mesh_helpers import Recorder
from helpers.polling import eventually

from meshnode.identity import NodeIdentity
from meshnode.transport.base import StreamReset
from meshnode.transport.quic import DialError, QuicConfig, QuicEndpoint
from meshnode.wire.framing import ALPN

pytestmark = pytest.mark.timeout(60)

WINDOW = 256 * 1024
SMALL = QuicConfig(
    stream_window=WINDOW,
    connection_window=2 * WINDOW,
    max_stream_backlog=WINDOW,
    max_connection_backlog=2 * WINDOW,
)


class Endpoints:
    def __init__(self, settings: QuicConfig | None = None) -> None:
        self.settings = settings
        self.a_id, self.b_id = NodeIdentity.generate(), NodeIdentity.generate()
        self.a_rec, self.b_rec = Recorder(), Recorder()

    async def __aenter__(self):
        self.a = await QuicEndpoint.listen(self.a_id, self.a_rec, settings=self.settings)
        self.b = await QuicEndpoint.listen(self.b_id, self.b_rec, settings=self.settings)
        host, port = self.b.local_address
        self.b_address = f"{host}:{port}"
        return self

    async def __aexit__(self, *exc):
        self.a.close()
        self.b.close()
        await asyncio.sleep(0.01)

    async def link(self):
        link = await self.a.dial(self.b_address, self.b_id.node_id)
        await eventually(lambda: self.b_rec.established)
        return link, self.b_rec.established[-1]


async def test_both_sides_learn_the_authenticated_peer_id():
    async with Endpoints() as ep:
        link, accepted = await ep.link()
        assert link.peer_id == ep.b_id.node_id and link.initiated_locally
        assert accepted.peer_id == ep.a_id.node_id and not accepted.initiated_locally
        assert ep.a_rec.established == [link]
        stream = await link.open_raw_stream()
        await stream.write(b"hi")
        remote = await ep.b_rec.next_stream()
        assert remote.peer_id == ep.a_id.node_id and await remote.read() == b"hi"


async def test_each_side_times_its_probes_by_how_soon_a_meshnode_peer_acknowledges():
    """aioquic tells its peer it may wait 25 ms to acknowledge, and the peer's probe timeout (how
    long a lost packet with nothing sent after it waits to be resent) includes that; a meshnode
    peer acknowledges within its ack_delay (5 ms), so both sides count 10 ms, or as told."""
    assert QuicConfig().ack_delay < QuicConfig().peer_max_ack_delay
    for settings, expected in ((QuicConfig(), 0.010), (QuicConfig(peer_max_ack_delay=None), 0.025)):
        async with Endpoints(settings) as ep:
            link, accepted = await ep.link()
            for side in (link, accepted):
                assert side.quic._loss.max_ack_delay == pytest.approx(expected)


async def test_dialing_the_wrong_node_id_is_refused():
    async with Endpoints() as ep:
        impostor = NodeIdentity.generate()
        with pytest.raises(DialError, match="not the expected node"):
            await ep.a.dial(ep.b_address, impostor.node_id)
        assert ep.a_rec.established == []


async def test_a_client_without_a_certificate_is_refused():
    async with Endpoints() as ep:
        host, port = ep.b.local_address
        config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
        async with connect(host, port, configuration=config) as client:
            await asyncio.wait_for(client.wait_closed(), 5)
        assert ep.b_rec.established == []
        assert not any(link.peer_id for link in ep.b.links)


async def test_a_client_with_another_alpn_is_refused():
    async with Endpoints() as ep:
        host, port = ep.b.local_address
        config = QuicConfiguration(is_client=True, alpn_protocols=["h3"], verify_mode=ssl.CERT_NONE)
        with pytest.raises(ConnectionError):
            async with connect(host, port, configuration=config):
                pass
        assert ep.b_rec.established == []


async def test_writes_wait_for_a_slow_reader_and_buffers_stay_bounded():
    async with Endpoints(SMALL) as ep:
        link, accepted = await ep.link()
        stream = await link.open_raw_stream()
        payload = bytes(range(256)) * (16 * 1024)  # 4 MiB, 16 stream windows
        writer = asyncio.create_task(stream.write(payload))
        remote = await ep.b_rec.next_stream()
        # Let the transfer run until it stalls on credit the reader never gives.
        for _ in range(20):
            await asyncio.sleep(0.02)
        assert not writer.done()
        assert remote.recv.size <= WINDOW  # receiver holds at most one window unread
        assert accepted.quic.app_unread <= 2 * WINDOW
        assert link.quic.send_backlog(stream.stream_id) <= WINDOW + 256 * 1024  # plus one write chunk
        received = bytearray()
        while len(received) < len(payload):
            received += await remote.read()
        await writer
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


async def test_a_stream_with_an_unsent_cap_keeps_the_rest_of_a_write_waiting_and_delivers_it_all():
    """A relay connection's one stream holds at most ``max_stream_unsent`` written and not yet
    sent; the rest of a write waits with its writer (in the queues where channels take turns)."""
    cap = 16 * 1024
    async with Endpoints(dataclasses.replace(SMALL, max_stream_unsent=cap)) as ep:
        link, _accepted = await ep.link()
        stream = await link.open_raw_stream()
        payload = bytes(range(256)) * (4 * 1024)  # 1 MiB, four stream windows
        writer = asyncio.create_task(stream.write(payload))
        remote = await ep.b_rec.next_stream()
        unsent_samples = []
        for _ in range(20):
            await asyncio.sleep(0.01)
            unsent_samples.append(link.quic.send_unsent(stream.stream_id))
        # Stalled on credit the reader does not give: what waits unsent stays within the cap.
        assert not writer.done()
        assert max(unsent_samples) <= cap
        assert link.quic.send_backlog(stream.stream_id) <= WINDOW + cap
        received = bytearray()
        while len(received) < len(payload):
            received += await remote.read()
        await writer
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


async def test_the_connection_window_bounds_many_unread_streams():
    async with Endpoints(SMALL) as ep:
        link, accepted = await ep.link()
        streams = [await link.open_raw_stream() for _ in range(6)]
        writers = [asyncio.create_task(s.write(b"z" * WINDOW)) for s in streams]
        for _ in range(20):
            await asyncio.sleep(0.02)
        assert accepted.quic.app_unread <= 2 * WINDOW
        assert not all(w.done() for w in writers)
        # Reading frees credit: with every stream read, every writer finishes. (A reader that
        # waits on one stream while others hog the connection window would starve: that is
        # the per-connection bound doing its job.)

        async def drain(stream):
            got = 0
            while got < WINDOW:
                got += len(await stream.read())
            return got

        readers = []
        for _ in streams:
            readers.append(asyncio.create_task(drain(await ep.b_rec.next_stream())))
        assert await asyncio.gather(*readers) == [WINDOW] * len(streams)
        await asyncio.gather(*writers)


async def test_reset_codes_reach_the_peer():
    async with Endpoints() as ep:
        link, _ = await ep.link()
        stream = await link.open_raw_stream()
        await stream.write(b"x")
        remote = await ep.b_rec.next_stream()
        remote.reset(0x10A)
        with pytest.raises(StreamReset) as info:
            await asyncio.wait_for(stream.read(), 5)
        assert info.value.error_code == 0x10A


async def test_keepalive_pings_hold_an_idle_link_open():
    settings = QuicConfig(idle_timeout=1.0, keepalive_interval=0.2)
    async with Endpoints(settings) as ep:
        link, accepted = await ep.link()
        await asyncio.sleep(2.5)  # well past the idle timeout, with no application traffic
        assert not link.is_closed and not accepted.is_closed


async def test_closing_a_link_tells_both_sides():
    async with Endpoints() as ep:
        link, accepted = await ep.link()
        link.close("done here")
        await eventually(lambda: accepted.is_closed)
        assert ep.a_rec.closed[-1][1] == "done here"
        assert "done here" in ep.b_rec.closed[-1][1]


async def test_peer_streams_are_recognised_once_even_out_of_order():
    async with Endpoints() as ep:
        _link, accepted = await ep.link()  # accepted: the server side, so peer streams are 0, 4, 8...
        assert [accepted.peer_streams.first_sight(i) for i in (8, 0, 4, 8, 0, 12, 4)] == [
            True,
            True,
            True,
            False,
            False,
            True,
            False,
        ]
        assert accepted.peer_streams.seen_ahead == set()  # nothing held once the gap closed


async def test_closing_a_stream_discards_what_the_peer_still_sends():
    async with Endpoints(SMALL) as ep:
        link, accepted = await ep.link()
        stream = await link.open_raw_stream()
        writer = asyncio.create_task(stream.write(b"q" * (4 * WINDOW)))
        remote = await ep.b_rec.next_stream()
        await remote.read()
        remote.close()  # done with it: stop reading
        with pytest.raises(StreamReset) as info:
            await asyncio.wait_for(writer, 10)  # STOP_SENDING ends the writer instead of stalling it
        assert info.value.error_code == 0
        await eventually(lambda: accepted.quic.app_unread == 0)
        assert await asyncio.wait_for(stream.read(), 5) == b""  # our reply side was finished cleanly


async def test_many_streams_reset_by_the_peer_do_not_use_up_the_stream_limit():
    async with Endpoints() as ep:
        link, _accepted = await ep.link()

        async def reset_all():
            while True:
                (await ep.b_rec.next_stream(timeout=10)).reset(0x7)

        resetter = asyncio.create_task(reset_all())
        try:
            for _ in range(300):  # well past aioquic's 128 concurrent streams
                stream = await link.open_raw_stream()
                await stream.write(b"x")
                stream.finish()
                with pytest.raises(StreamReset):
                    await asyncio.wait_for(stream.read(), 5)
        finally:
            resetter.cancel()


async def test_a_closed_endpoint_frees_its_port_for_a_restart_in_the_same_process():
    identity = NodeIdentity.generate()
    first = await QuicEndpoint.listen(identity, Recorder(), "127.0.0.1", 0)
    port = first.local_address[1]
    first.close()
    await first.wait_closed()
    again = await QuicEndpoint.listen(identity, Recorder(), "127.0.0.1", port)
    assert again.local_address[1] == port
    again.close()
    await again.wait_closed()
