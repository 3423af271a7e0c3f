"""Helpers of the mesh tests: link recorders, fake links, raw QUIC peers, signed gossip entries.

In-process nodes (``fast_config``, ``start_first_node``, ``start_joiner``) and ``eventually``
are in ``tests/helpers``, shared with the other test directories.
"""

from __future__ import annotations

import asyncio
import time

from meshnode.identity import NodeIdentity
from meshnode.mesh.signed_record import decode_record, sign_record
from meshnode.node import Node
from meshnode.transport.base import MeshStream, PeerLink, StreamReset
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicConfig, QuicEndpoint
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import refusal_from_reset_code
from meshnode.wire.pb import mesh


def signed_entry(identity: NodeIdentity, announcement: mesh.PeerAnnouncement) -> mesh.GossipEntry:
    """``announcement`` (of ``identity``, whose id it gets) as a gossip entry its node signed."""
    announcement.endpoint_id = identity.node_id
    return mesh.GossipEntry(record=sign_record(identity, announcement))


def entry_ids(frame: mesh.GossipFrame) -> set[bytes]:
    """The node ids a GossipFrame's entries name."""
    return {bytes(decode_record(e.record).endpoint_id) for e in frame.entries}


class Recorder:
    """A LinkHandler that records what the transport reports."""

    def __init__(self) -> None:
        self.established: list[PeerLink] = []
        self.accepted: list[MeshStream] = []
        self.closed: list[tuple[PeerLink, str]] = []
        self.stream_arrived = asyncio.Event()

    def link_established(self, link: PeerLink) -> None:
        self.established.append(link)

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.accepted.append(stream)
        self.stream_arrived.set()

    def link_closed(self, link: PeerLink, reason: str) -> None:
        self.closed.append((link, reason))

    async def next_stream(self, timeout: float = 5.0) -> MeshStream:
        async with asyncio.timeout(timeout):
            while not self.accepted:
                self.stream_arrived.clear()
                await self.stream_arrived.wait()
        return self.accepted.pop(0)


class FakeLink(PeerLink):
    """A link seen from one end: to ``peer_id``, dialed by this end or not, up since ``at``."""

    def __init__(self, peer_id: bytes, *, dialed_here: bool, at: float, name: str = "") -> None:
        self.peer_id = peer_id
        self.initiated_locally = dialed_here
        self.established_at = at
        self.name = name
        self.close_reason: str | None = None
        self._closed = asyncio.Event()

    async def open_raw_stream(self) -> MeshStream:
        raise AssertionError("not used")

    def close(self, reason: str = "") -> None:
        if self.close_reason is None:
            self.close_reason = reason
        self._closed.set()

    @property
    def description(self) -> str:
        return self.name


class RawPeer:
    """A bare QUIC endpoint with its own identity, for sending arbitrary frames to a node."""

    def __init__(self, identity: NodeIdentity | None = None, settings: QuicConfig | None = None) -> None:
        self.identity = identity or NodeIdentity.generate()
        self.recorder = Recorder()
        self.settings = settings
        self.endpoint: QuicEndpoint | None = None

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    async def __aenter__(self) -> RawPeer:
        self.endpoint = await QuicEndpoint.listen(self.identity, self.recorder, "127.0.0.1", 0, self.settings)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.endpoint is not None
        self.endpoint.close()
        await asyncio.sleep(0)

    async def connect(self, node: Node) -> PeerLink:
        assert self.endpoint is not None
        return await self.endpoint.dial(node.addresses[0], node.node_id)

    def announcement(self, mesh_id: str) -> mesh.PeerAnnouncement:
        assert self.endpoint is not None
        host, port = self.endpoint.local_address
        return mesh.PeerAnnouncement(
            endpoint_id=self.node_id,
            mesh_id=mesh_id,
            incarnation=time.time_ns(),
            addresses=[f"{host}:{port}"],
        )

    def entry(self, mesh_id: str) -> mesh.GossipEntry:
        """Our own announcement, signed: the sender's entry of a GossipFrame."""
        return signed_entry(self.identity, self.announcement(mesh_id))


async def exchange(
    link: PeerLink, stream_type: StreamType, body: bytes, timeout: float = 3.0
) -> bytes | None:
    """Open a stream, send one frame, finish, and return the reply frame (None at a clean end)."""
    stream = await link.open_stream(stream_type)
    await stream.send_frame(body)
    stream.finish()
    return await stream.recv_frame(timeout)


async def reset_code_of(stream: FramedStream | MeshStream, timeout: float = 3.0) -> int:
    """Read (frames, or raw bytes) until the stream is reset; return the mesh error code the reset carries."""
    try:
        async with asyncio.timeout(timeout):
            if isinstance(stream, FramedStream):
                while await stream.recv_frame() is not None:
                    pass
            else:
                while await stream.read():
                    pass
    except StreamReset as exc:
        refusal = refusal_from_reset_code(exc.error_code)
        assert refusal is not None, f"reset code 0x{exc.error_code:x} is not a mesh refusal"
        return refusal.code
    raise AssertionError("stream ended cleanly instead of being reset")
