"""Under delta gossip a node keeps gossip links only to its active view: a link to a peer
outside it is closed once nothing lives on it, and never while a stream (a route's session,
a transfer) does. Three nodes over real QUIC, with an active view of one."""

import asyncio

import pytest
from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from meshnode.mesh.partial_view import links_to_close
from meshnode.wire.framing import StreamType

pytestmark = pytest.mark.timeout(60)

ONE_PEER_VIEW = {"delta_gossip": True, "gossip_fanout": 1, "active_view": 1, "heartbeat_interval": 0.2}
# A stream type these nodes serve nothing on: the test's stand-in for a route's session.
HELD = StreamType.SHARD_SESSION


def test_only_idle_links_outside_the_view_and_not_busy_are_closed():
    a, b, c, d, e = (bytes([i]) * 32 for i in range(5))
    counts = {a: 0, b: 0, c: 2, d: None, e: 0}
    assert links_to_close(counts, active=[a], busy=[e]) == [b]


async def test_a_link_outside_the_active_view_stays_while_a_stream_lives_on_it_then_closes(tmp_path):
    first = await start_first_node(tmp_path, **ONE_PEER_VIEW)
    second = await start_joiner(tmp_path, "second", first, **ONE_PEER_VIEW)
    third = await start_joiner(tmp_path, "third", first, **ONE_PEER_VIEW)
    nodes = [first, second, third]
    released = asyncio.Event()

    async def hold(stream):
        await stream.recv_frame(timeout=10)
        await released.wait()
        await stream.send_frame(b"done")
        stream.finish()

    try:
        for node in (second, third):
            node.register_handler(HELD, hold)
        await eventually(lambda: all(len(node.state.table) == 2 for node in nodes))
        links, streams = [], []
        for peer in (second, third):
            link = await first.get_link(peer.node_id)
            stream = await link.open_stream(HELD)
            await stream.send_frame(b"hold")
            links.append(link)
            streams.append(stream)
        gossip = first.delta_gossip
        start = gossip.swim.rounds
        # Rounds pass; at most one of the two peers is in the view at a time, yet neither link
        # carrying a stream is closed.
        await eventually(lambda: gossip.swim.rounds > start + 10)
        assert len(gossip.view.active) <= 1
        assert not any(link.is_closed for link in links)
        closed_before = gossip.links_closed
        released.set()
        for stream in streams:
            assert await stream.recv_frame(timeout=10) == b"done"
            stream.finish()
        # Idle now: the link to whichever peer is outside the view is closed at a round.
        await eventually(lambda: gossip.links_closed > closed_before)
        await eventually(lambda: any(link.is_closed for link in links))
    finally:
        for node in reversed(nodes):
            await node.shutdown()
