"""Session leases at a served shard, in process: membership and link loss reach the worker.

A :class:`ShardService` on a loopback mesh peer, on the fake engine, with a
membership test the test controls (a mesh node passes ``node.state.is_admitted``).
The same rules between real processes over real QUIC are in test_session_leases.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.loopback_mesh import AnnouncingPeer, LoopbackMesh
from helpers.polling import eventually
from helpers.recording_engine import SPEC

from engines.fake import FakeEngine
from meshnode.app.shard_service import ShardService, ShardServiceConfig
from meshnode.dataplane.edges.shard_session import ShardSession
from meshnode.dataplane.lease import LeaseConfig, ReleaseReason
from meshnode.head.local_link import LocalShardLink
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard

from .harness import srange

pytestmark = pytest.mark.timeout(30)


@dataclass
class Served:
    loopback: LoopbackMesh
    node: AnnouncingPeer
    service: ShardService
    # The peers membership admits.
    members: set[bytes]

    def member(self, index: int):
        peer = self.loopback.add(index)
        self.members.add(peer.node_id)
        return peer

    @property
    def worker(self):
        return self.service.server.worker

    def open(self, links: object) -> object:
        assert self.node.serving is not None
        fingerprint = self.node.serving.fingerprint
        return ShardSession.open(links, fingerprint=fingerprint, shard_range=srange(0, SPEC.total_layers))


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    loopback = LoopbackMesh()
    node = AnnouncingPeer(loopback, 1)
    members: set[bytes] = set()
    leases = LeaseConfig(peer_share=0.5, owner_grace_s=0.2)
    options = ShardServiceConfig(model=Path("fake-model.gguf"), ctx=64, max_sessions=4, leases=leases)
    service = await ShardService.start(
        node,
        options,
        refresh_interval_s=0.02,
        engine_factory=lambda: FakeEngine(SPEC),
        is_member=members.__contains__,
    )
    yield Served(loopback, node, service, members)
    await service.aclose()
    await loopback.aclose()


async def test_a_peer_that_membership_drops_loses_its_sessions(served: Served) -> None:
    client, other = served.member(2), served.member(3)
    mine = await served.open(await client.get_link(served.node.node_id))
    theirs = await served.open(await other.get_link(served.node.node_id))
    await mine.prefill([1, 2, 3])
    await theirs.prefill([4, 5])
    assert served.worker.load().active_sessions == 2
    served.members.discard(client.node_id)  # confirmed down, or it left
    await eventually(lambda: served.worker.load().active_sessions == 1)
    assert served.worker.releases[ReleaseReason.OWNER_DEPARTED] == 1
    with pytest.raises(ShardProtocolError) as gone:
        await mine.decode(7, position=3)
    assert gone.value.code == shard.ERROR_CODE_CACHE_MISS  # re-admitted empty: the head re-prefills
    assert (await theirs.decode(7, position=2)).token is not None
    mine.abort()
    await theirs.aclose()


async def test_a_lost_links_sessions_end_after_the_grace(served: Served) -> None:
    client = served.member(2)
    session = await served.open(await client.get_link(served.node.node_id))
    await session.prefill([1, 2, 3])
    link = session.link
    assert link is not None
    link.close("cable pulled")
    await eventually(lambda: served.worker.load().active_sessions == 0)
    assert served.worker.releases[ReleaseReason.LINK_CLOSED] == 1
    session.abort()


async def test_a_peer_gets_its_share_and_this_nodes_own_head_still_gets_sessions(served: Served) -> None:
    client = served.member(2)
    link = await client.get_link(served.node.node_id)
    held = [await served.open(link) for _ in range(2)]
    with pytest.raises(ShardProtocolError) as refused:
        await served.open(link)
    assert refused.value.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED and refused.value.retryable
    assert served.worker.share_refusals == 1
    # This node's own head reaches its shard through an in-process link under its own id.
    local = LocalShardLink(served.node.node_id)
    served.service.server.register(local.register)
    own = [await served.open(local.link) for _ in range(2)]
    assert served.worker.load().active_sessions == 4
    for session in [*held, *own]:
        await session.aclose()
    await local.aclose()
    assert served.worker.releases[ReleaseReason.RELEASED] == 4
