"""Under delta gossip a node keeps gossip links only to its active view: a link to a peer
outside it is closed once nothing lives on it, and never while a stream (a route's session,
a transfer) does. Three nodes with an active view of one, over real QUIC, and again reaching
each other only through a relay (relayed links, whose channels count as a QUIC link's streams)."""

import asyncio
import contextlib

import pytest
from helpers.mesh_nodes import (
    first_member,
    invite_from,
    relay_only_config,
    start_first_node,
    start_invited_node,
    start_joiner,
    start_relay_server,
)
from helpers.polling import eventually

from meshnode.membership.credentials import MeshKey
from meshnode.mesh.partial_view import links_to_close
from meshnode.wire.framing import StreamType

pytestmark = pytest.mark.timeout(60)

ONE_PEER_VIEW = {"delta_gossip": True, "gossip_fanout": 1, "active_view": 1, "heartbeat_interval": 0.2}
# A stream type these nodes serve nothing on: the test's stand-in for a route's session.
HELD = StreamType.SHARD_SESSION


def test_only_idle_links_outside_the_view_and_not_busy_are_closed():
    a, b, c, d, e, f = (bytes([i]) * 32 for i in range(6))
    counts = {a: 0, b: 0, c: 2, d: None, e: 0, f: 0}
    # f carried a stream when the last round looked, or its peer opened one since: the reply we
    # sent on it may be unread.
    assert links_to_close(counts, active=[a], busy=[e], quiet=[a, b, c, d, e]) == [b]


async def start_direct(tmp_path, cleanup):
    first = await start_first_node(tmp_path, **ONE_PEER_VIEW)
    cleanup.push_async_callback(first.shutdown)
    nodes = [first]
    for name in ("second", "third"):
        nodes.append(await start_joiner(tmp_path, name, first, **ONE_PEER_VIEW))
        cleanup.push_async_callback(nodes[-1].shutdown)
    return nodes


async def start_relayed(tmp_path, cleanup):
    """Relay-only nodes (NAT, in one process): every link between them goes through the relay."""
    mesh_key = MeshKey.generate()
    server, relay = await start_relay_server(mesh_key)
    cleanup.push_async_callback(server.close, flush_timeout=0.3)
    first = first_member(tmp_path / "first", relay_only_config(relay, **ONE_PEER_VIEW), mesh_key)
    cleanup.push_async_callback(first.shutdown)
    await first.start()
    await eventually(lambda: first.relay_links is not None and first.relay_links.registered_relays(), 20)
    nodes = [first]
    for name in ("second", "third"):
        config = relay_only_config(relay, **ONE_PEER_VIEW)
        nodes.append(await start_invited_node(tmp_path / name, config, invite_from(first, relays=[relay])))
        cleanup.push_async_callback(nodes[-1].shutdown)
    return nodes


@pytest.mark.parametrize("relayed", [False, True], ids=["direct", "relayed"])
async def test_a_link_outside_the_active_view_stays_while_a_stream_lives_on_it_then_closes(tmp_path, relayed):
    released = asyncio.Event()

    async def hold(stream):
        await stream.recv_frame(timeout=10)
        await released.wait()
        await stream.send_frame(b"done")
        stream.finish()

    async with contextlib.AsyncExitStack() as cleanup:
        nodes = await (start_relayed if relayed else start_direct)(tmp_path, cleanup)
        first, second, third = nodes
        for node in (second, third):
            node.register_handler(HELD, hold)
        await eventually(lambda: all(len(node.state.table) == 2 for node in nodes), 20)
        links, streams = [], []
        for peer in (second, third):
            link = await first.get_link(peer.node_id)
            stream = await link.open_stream(HELD)
            await stream.send_frame(b"hold")
            links.append(link)
            streams.append(stream)
        # Relayed links in the relayed mesh, whose channels count as streams; direct ones otherwise.
        assert [link.relay_id is not None for link in links] == [relayed, relayed]
        gossip = first.delta_gossip
        start = gossip.swim.rounds
        # Rounds pass; at most one of the two peers is in the view at a time, yet neither link
        # carrying a stream is closed.
        await eventually(lambda: gossip.swim.rounds > start + 10)
        assert len(gossip.view.active) <= 1
        assert not any(link.is_closed for link in links), [link.close_reason for link in links]
        closed_before = gossip.links_closed
        released.set()
        for stream in streams:
            assert await stream.recv_frame(timeout=10) == b"done"
            stream.finish()
        # Idle now: the link to whichever peer is outside the view is closed at a round.
        await eventually(lambda: gossip.links_closed > closed_before)
        await eventually(lambda: any(link.is_closed for link in links))
