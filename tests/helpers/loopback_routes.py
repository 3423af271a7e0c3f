"""A route environment for the driver over the data plane's in-process loopback mesh.

Real shard servers (fake engines), real dispatchers and streams; the driver's own
node serves the first shard through a :class:`LocalShardLink`, exactly as a
mesh node does. Gossip is a list of announcements the test controls, so a
killed peer stays announced (stale gossip) until the driver excludes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engines.interface import GREEDY, SamplingParams, SessionKey, StepRequest
from engines.sampling import sample_token
from helpers.loopback_mesh import LoopbackMesh, MeshPeer
from helpers.recording_engine import RecordingEngine
from meshnode.app.shard_service import served_shard
from meshnode.dataplane.edges.server import ShardServer
from meshnode.head.candidates import shard_candidates
from meshnode.head.driver import DriverConfig
from meshnode.head.local_link import LocalShardLink
from meshnode.head.planner import ModelIdentity, ShardCandidate
from meshnode.identity import NodeIdentity
from meshnode.transport.base import PeerLink
from meshnode.wire.pb import mesh

DRIVER_INDEX = 1


@dataclass
class Shard:
    peer: MeshPeer
    engine: RecordingEngine
    server: ShardServer
    announcement: mesh.PeerAnnouncement

    @property
    def node_id(self) -> bytes:
        return self.peer.node_id


@dataclass
class LoopbackRoutes:
    mesh: LoopbackMesh = field(default_factory=LoopbackMesh)
    shards: dict[int, Shard] = field(default_factory=dict)
    local: LocalShardLink | None = None
    hidden: set[bytes] = field(default_factory=set)
    alive_calls: int = 0
    # Every peer has a node key (its id is the key's) and its shard signs its units' commitments.
    signed: bool = False

    def __post_init__(self) -> None:
        self.me = self._add_peer(DRIVER_INDEX)

    def identity(self, index: int) -> NodeIdentity | None:
        """Peer ``index``'s node key (the same every run), when the peers sign."""
        return NodeIdentity.from_seed(bytes([index]) * 32) if self.signed else None

    def _add_peer(self, index: int) -> MeshPeer:
        identity = self.identity(index)
        return self.mesh.add(index, None if identity is None else identity.node_id)

    async def add_shard(
        self,
        index: int,
        start: int,
        end: int,
        engine_class: type[RecordingEngine] = RecordingEngine,
        **engine_options: Any,
    ) -> Shard:
        """A server for ``[start, end)`` on peer ``index`` (``DRIVER_INDEX``: this node, served locally)."""
        peer = self.me if index == DRIVER_INDEX else self._add_peer(index)
        engine = engine_class(start, end, **engine_options)
        server = ShardServer(engine, links=peer.get_link, identity=self.identity(index))
        assert (await server.start()).validated
        if index == DRIVER_INDEX:
            self.local = LocalShardLink(peer.node_id)
            server.register(self.local.register)
        else:
            server.register(peer.register_handler)
        engine.calls.clear()
        engine.released.clear()
        caps = engine.capabilities()
        announcement = mesh.PeerAnnouncement(endpoint_id=peer.node_id)
        announcement.serving.CopyFrom(served_shard(caps, "fake", states_handoffs=self.signed))
        announcement.capacity.max_concurrent_sessions = caps.max_sessions
        shard = Shard(peer, engine, server, announcement)
        self.shards[index] = shard
        return shard

    # RouteEnvironment
    def candidates(self) -> list[ShardCandidate]:
        return shard_candidates(
            (s.node_id, s.announcement) for s in self.shards.values() if s.node_id not in self.hidden
        )

    async def link(self, node_id: bytes) -> PeerLink:
        if node_id == self.me.node_id:
            assert self.local is not None
            return await self.local.link()
        return await self.me.get_link(node_id)

    async def alive(self, node_id: bytes, probe_timeout: float) -> bool:
        self.alive_calls += 1
        return not self.mesh.down.get(node_id, False)

    @property
    def model(self) -> ModelIdentity:
        (identity,) = {c.model for c in self.candidates()}
        return identity

    def servers(self) -> Iterable[ShardServer]:
        return (s.server for s in self.shards.values())

    async def aclose(self) -> None:
        for shard in self.shards.values():
            await shard.server.aclose()
        if self.local is not None:
            await self.local.aclose()
        await self.mesh.aclose()


def reference(prompt: list[int], count: int, sampling: SamplingParams = GREEDY) -> list[int]:
    """What the whole fake model generates, run directly on one engine (sampling at each position)."""
    engine = RecordingEngine(0, 4, max_context=4096)
    key = SessionKey("reference", 1)
    result = engine.prefill(
        StepRequest(session=key, first_position=0, token_ids=tuple(prompt), want_logits=True)
    )
    tokens: list[int] = []
    position = len(prompt)
    while True:
        assert result.logits is not None
        tokens.append(sample_token(result.logits, sampling, position))
        if len(tokens) == count:
            return tokens
        result = engine.decode(
            StepRequest(
                session=key,
                first_position=position,
                token_ids=(tokens[-1],),
                expected_past_len=position,
                want_logits=True,
            )
        )
        position += 1


# The shards of the three-hop route driver tests use: the driver's own [0, 2), then these.
MIDDLE, SPARE, TAIL = 2, 4, 3
FAST = DriverConfig(stall_probe_s=0.2, probe_timeout_s=0.5, control_timeout_s=1.0, open_timeout_s=2.0)


@contextlib.asynccontextmanager
async def three_hop_routes(
    engine_class: type[RecordingEngine] = RecordingEngine, *, signed: bool = False, **engine_options: object
) -> AsyncIterator[LoopbackRoutes]:
    """The driver's [0, 2), MIDDLE's [2, 3) and TAIL's [3, 4); SPARE is the index for a replica.
    ``signed``: every peer has a node key and signs its units' commitments."""
    routes = LoopbackRoutes(signed=signed)
    try:
        await routes.add_shard(DRIVER_INDEX, 0, 2, engine_class, **engine_options)
        await routes.add_shard(MIDDLE, 2, 3, engine_class, **engine_options)
        await routes.add_shard(TAIL, 3, 4, engine_class, **engine_options)
        yield routes
    finally:
        await routes.aclose()


async def collect(
    stream: AsyncIterator[int], *, on_token: Callable[[int], Awaitable[None]] | None = None
) -> list[int]:
    """Every token of a generation; ``on_token(count)`` after each (to act mid-generation)."""
    tokens = []
    async for token in stream:
        tokens.append(token)
        if on_token is not None:
            await on_token(len(tokens))
    return tokens
