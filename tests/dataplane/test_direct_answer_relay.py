"""The direct answer through a relay: a tail behind NAT answers the head on a relay channel.

Three relay-only nodes (as behind NAT) and a client; the client's session to the head
shard takes its tokens straight from the tail over its own link to the tail, which
is a sealed relay channel carrying the very frames a QUIC stream would.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers.polling import eventually
from helpers.recording_engine import LAYERS

from meshnode.dataplane.edges.shard_session import DirectAnswers, ShardSession
from meshnode.dataplane.route import make_hop

from .fake_shards import SPLIT, RelayedChain, relayed_chain
from .harness import reference, srange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = [5, 3, 8, 1, 9, 2, 7]


def session_with_direct_answers(chain: RelayedChain) -> Any:
    """The client's session to the head shard, taking its tokens straight from the tail."""
    tail, client = chain.tail, chain.client
    return ShardSession.open(
        lambda: client.get_link(chain.head.node_id),
        fingerprint=chain.services[0].served.fingerprint,
        shard_range=srange(0, SPLIT),
        downstream=[make_hop(tail.node_id, SPLIT, LAYERS, SPLIT)],
        answers=DirectAnswers(links=lambda: client.get_link(tail.node_id), tail_range=srange(SPLIT, LAYERS)),
    )


async def test_a_relayed_tail_answers_the_head_directly_through_the_relay(tmp_path: Path) -> None:
    async with relayed_chain(tmp_path) as chain:
        tail, client, services = chain.tail, chain.client, chain.services
        # The client reaches the tail once it knows it: membership first, then the answer stream.
        await eventually(lambda: any(e.peer_id == tail.node_id for e in client.peers()), 10)
        await client.get_link(tail.node_id)
        async with session_with_direct_answers(chain) as session:
            assert await session.answers_ready()
            first = await session.prefill(PROMPT)
            tokens = [first.token]
            outputs = [first.chunks[-1]]
            for position in range(len(PROMPT), len(PROMPT) + 5):
                outputs.append(await session.decode(tokens[-1], position=position))
                tokens.append(outputs[-1].token)
        assert tokens == reference(PROMPT, 5)
        assert all(output.done.answered_directly for output in outputs)
        assert services[1].server.worker.direct_answers == 6
        assert (await client.get_link(tail.node_id)).description.startswith("relay ")
        await eventually(lambda: not services[1].server.load().active_sessions, 10)


async def test_the_answer_stream_moves_to_a_direct_link_that_replaces_the_relayed_one(tmp_path: Path) -> None:
    """A direct link to the tail comes up mid-generation (a punched hole): the relayed link drains
    and closes, the answer stream moves over without losing an answer, no unit fails."""
    async with relayed_chain(tmp_path) as chain:
        tail, client, services = chain.tail, chain.client, chain.services
        await eventually(lambda: any(e.peer_id == tail.node_id for e in client.peers()), 10)
        relayed = await client.get_link(tail.node_id)
        async with session_with_direct_answers(chain) as session:
            assert await session.answers_ready()
            first = await session.prefill(PROMPT)
            tokens, outputs = [first.token], [first.chunks[-1]]
            position = len(PROMPT)
            for _ in range(3):
                outputs.append(await session.decode(tokens[-1], position=position))
                tokens.append(outputs[-1].token)
                position += 1
            assert client.endpoint is not None and tail.endpoint is not None
            direct = await client.endpoint.dial(tail.addresses[0], tail.node_id)
            assert client.link_to(tail.node_id) is direct and not relayed.is_closed  # draining
            # Decode through the drain and past the relayed link's close.
            while not relayed.is_closed or len(outputs) < 30:
                outputs.append(await session.decode(tokens[-1], position=position))
                tokens.append(outputs[-1].token)
                position += 1
                await asyncio.sleep(0.1)  # the drain takes 2 s; the fake model's context is 64
        assert tokens == reference(PROMPT, len(tokens) - 1)
        assert all(output.done.answered_directly for output in outputs)
        assert services[1].server.worker.direct_answers == len(outputs)
        assert relayed.close_reason == "replaced by a direct link"
