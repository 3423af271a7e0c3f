"""The same data plane over relay channels: three nodes that cannot dial each other, one relay.

Each node is a real ``Node`` (relay-only, as behind NAT) serving its shard through
``ShardService``; the client's session and the head's forward to the tail both
travel as sealed relay channels, served by the same dispatcher as QUIC streams.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.polling import eventually
from helpers.recording_engine import LAYERS

from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.route import make_hop

from .fake_shards import SPLIT, relayed_chain
from .harness import reference, srange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = [5, 3, 8, 1, 9, 2, 7]


async def test_a_split_chain_runs_over_relay_channels(tmp_path: Path) -> None:
    async with relayed_chain(tmp_path) as chain:
        head, tail, client, services = chain.head, chain.tail, chain.client, chain.services
        link = await client.get_link(head.node_id)
        assert link.description.startswith("relay ")
        fingerprint = services[0].served.fingerprint
        async with ShardSession.open(
            lambda: client.get_link(head.node_id),
            fingerprint=fingerprint,
            shard_range=srange(0, SPLIT),
            downstream=[make_hop(tail.node_id, SPLIT, LAYERS, SPLIT)],
        ) as session:
            tokens = [(await session.prefill(PROMPT)).token]
            for position in range(len(PROMPT), len(PROMPT) + 5):
                tokens.append((await session.decode(tokens[-1], position=position)).token)
        assert tokens == reference(PROMPT, 5)
        # The head reached the tail through the relay too.
        head_to_tail = await head.get_link(tail.node_id)
        assert head_to_tail.description.startswith("relay ")
        # The release passed along the chain.
        await eventually(lambda: not services[1].server.load().active_sessions, 10)
