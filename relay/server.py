"""The relay's QUIC edge: moves frames between client connections and :class:`RelayCore`.

It runs on meshnode's QUIC endpoint (mutual Ed25519 authentication, bounded
receive windows, keepalive PINGs) with the relay's own ALPN and identity key.
Per client connection the relay opens one stream, then:

* a reader task decodes frames into the core and, when the core says the
  client's rate buckets are in debt, stops reading for that long (QUIC flow
  control then slows the client; nobody else waits). It holds frames to the
  size the core allows (a registration's until the client registered), and
  what it holds of an incomplete frame to the connection's and the process's
  buffer caps and the stall timeout (``meshnode.transport.read_limits``); a
  client that breaks them is refused with the matching code and closed;
* a writer task writes what the core hands out, only as fast as the client
  acknowledges, so a slow client's frames wait in the core's bounded queues;
* a follower task tells the core when the client's datagrams come from a new
  address (QUIC followed a NAT that remapped it; ``QuicLink.moved``).

The core's timer (registrations that time out) runs on a
:class:`~meshnode.timer_edge.TimerEdge`: the relay wakes when ``RelayCore.get_timer()``
says, not on a poll.

When the core closes a connection, its last message (the refusal) is flushed
first and its text is also the QUIC close reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.identity import NodeIdentity, load_or_create_identity, short_id
from meshnode.membership.store import DataDir
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.relaywire import protocol as p
from meshnode.sansio import SECOND_NS
from meshnode.timer_edge import TimerEdge
from meshnode.transport.base import MeshStream, PeerLink, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import QuicConfig, QuicEndpoint, QuicLink
from meshnode.transport.udp_address import describe_sockaddr
from meshnode.wire.errors import FramingError
from relay.core import RelayCore, RelayPolicy

log = logging.getLogger(__name__)

# A refusal is flushed before the connection closes, for at most this long.
_FLUSH_TIMEOUT_S = 2.0
# Nodes whose last refusal is remembered, so that a retry with the same mistake is not logged again.
_REFUSALS_REMEMBERED = 1024


@dataclass
class _Client:
    conn_id: int
    link: QuicLink
    framed: FramedStream | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Closes a connection the core gave up on even if its writer is stuck behind a client
    # that stopped reading (the refusal can then never be flushed).
    close_timer: asyncio.TimerHandle | None = None
    registered: bool = False
    # The client's address as last told to the core ("host:port").
    address: str = ""


def load_relay_identity(data_dir: Path) -> tuple[NodeIdentity, bool]:
    """The relay's identity key in its own data directory (0600), created on first use."""
    return load_or_create_identity(data_dir)


class RelayServer:
    def __init__(
        self,
        identity: NodeIdentity,
        meshes: set[str],
        policy: RelayPolicy | None = None,
        *,
        quic: QuicConfig | None = None,
        flush_timeout: float = _FLUSH_TIMEOUT_S,
        data_dir: Path | None = None,
    ) -> None:
        self.identity = identity
        self.policy = policy or RelayPolicy()
        # Where the revocations members hand over are kept, so a restarted relay still refuses them.
        self._store = DataDir(data_dir) if data_dir is not None else None
        stored = self._store.load_revocations() if self._store is not None else []
        self.core = RelayCore(identity.node_id, meshes, self.policy, revocations=stored)
        base = quic or QuicConfig()
        self.quic_config = dataclasses.replace(
            base,
            alpn=p.RELAY_ALPN,
            keepalive_interval=min(base.keepalive_interval, self.policy.keepalive_s),
            max_links=max(base.max_links, self.policy.max_connections),
            max_stream_unsent=p.MAX_UNSENT_BYTES,
        )
        self.endpoint: QuicEndpoint | None = None
        self._ids = itertools.count(1)
        self._clients: dict[PeerLink, _Client] = {}
        self._by_conn: dict[int, _Client] = {}
        # The core's timer (registrations that time out), armed on start.
        self._timer: TimerEdge | None = None
        self._flush_timeout = flush_timeout
        # Times a client ran ahead of its rate limits and the relay stopped reading from it.
        self.read_pauses = 0
        # Registrations, their ends and refusals, for the operator; strangers cannot flood it.
        self._client_log = RateLimitedLog(log)
        self._last_refusal: dict[bytes, str] = {}  # by node id, oldest first
        self._closing = False

    @property
    def relay_id(self) -> bytes:
        return self.identity.node_id

    @property
    def address(self) -> tuple[str, int]:
        assert self.endpoint is not None
        return self.endpoint.local_address

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._timer = TimerEdge(self.core.get_timer, self._on_timer)
        self.endpoint = await QuicEndpoint.listen(self.identity, self, host, port, self.quic_config)
        bound_host, bound_port = self.endpoint.local_address
        log.info(
            "relay %s listening on %s:%d (QUIC %s), meshes %s",
            short_id(self.relay_id),
            bound_host,
            bound_port,
            p.RELAY_ALPN,
            ", ".join(sorted(self.core.meshes)),
        )

    async def close(self, flush_timeout: float = _FLUSH_TIMEOUT_S) -> None:
        """Tell every client the relay is going away (waiting up to ``flush_timeout``), then close."""
        self._flush_timeout = flush_timeout
        self._closing = True  # "relay stopping" says it for every client
        self.core.shutdown()
        self._wake()
        clients = list(self._clients.values())
        if clients:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(flush_timeout):
                    await asyncio.gather(*(c.link.wait_closed() for c in clients), return_exceptions=True)
        if self._timer is not None:
            self._timer.close()
        for client in list(self._clients.values()):
            for task in client.tasks:
                task.cancel()
        if self.endpoint is not None:
            self.endpoint.close()
            await self.endpoint.wait_closed()  # a relay restarted in the same process rebinds its port
        await asyncio.sleep(0)

    def member_addresses(self) -> dict[bytes, str]:
        """Where each registered member connects from, by node id (as the relay sees it: a NATed
        member's router)."""
        addresses = {}
        for client in self._clients.values():
            node_id = self.core.registered_node(client.conn_id)
            if node_id is not None:
                addresses[node_id] = client.address
        return addresses

    # -- LinkHandler -----------------------------------------------------------------

    def link_established(self, link: PeerLink) -> None:
        assert isinstance(link, QuicLink)
        loop = asyncio.get_running_loop()
        client = _Client(conn_id=next(self._ids), link=link)
        self._clients[link] = client
        self._by_conn[client.conn_id] = client
        client.address = describe_sockaddr(link.remote_address)
        self.core.connection_made(
            client.conn_id,
            link.peer_id,
            time.monotonic_ns(),
            source=link.remote_address[0],
            address=client.address,
        )
        if self._timer is not None:
            self._timer.rearm()  # the new connection's registration deadline may be the next one
        client.tasks.append(loop.create_task(self._serve(client)))
        client.tasks.append(loop.create_task(self._follow_address(client)))

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        # Clients use only the stream the relay opened.
        stream.reset(p.relay.RELAY_ERROR_PROTOCOL)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        client = self._clients.pop(link, None)
        if client is None:
            return
        assert isinstance(link, QuicLink)  # the relay's endpoint makes QUIC links only
        self._by_conn.pop(client.conn_id, None)
        self.core.connection_lost(client.conn_id)
        if client.registered and not self._closing:
            self._client_log.log(logging.INFO, "%s left: %s", _who(link), reason)
        if client.close_timer is not None:
            client.close_timer.cancel()
        for task in client.tasks:
            task.cancel()
        self._wake()

    # -- per connection --------------------------------------------------------------------

    async def _serve(self, client: _Client) -> None:
        try:
            stream = await client.link.open_raw_stream()
        except StreamError:
            return
        client.framed = FramedStream(
            stream, expect_stream_type=False, max_frame_bytes=p.MAX_RELAY_FRAME_BYTES
        )
        # Sends may be as large as any relay frame; what we read is the core's to bound.
        client.framed.max_recv_frame_bytes = self.core.max_frame_bytes(client.conn_id)
        client.tasks.append(asyncio.get_running_loop().create_task(self._read_loop(client, client.framed)))
        await self._write_loop(client, client.framed)

    def _save_revocations(self) -> None:
        self.core.revocations_changed = False
        if self._store is None:
            return
        try:
            self._store.save_revocations(self.core.revocations())
        except OSError as exc:
            log.warning("could not save revocations: %s", exc)
        log.info("now refusing %d revoked member(s) or invite(s)", len(self.core.revocations()))

    async def _read_loop(self, client: _Client, framed: FramedStream) -> None:
        core = self.core
        try:
            while not core.is_closing(client.conn_id):
                body = await framed.recv_frame()
                if body is None:
                    client.link.close("client finished its relay stream")
                    return
                core.receive_frame(client.conn_id, body, time.monotonic_ns(), unix_now=time.time())
                if not client.registered and core.registered_node(client.conn_id) is not None:
                    client.registered = True
                    self._client_log.log(logging.INFO, "registered %s", _who(client.link))
                if core.revocations_changed:
                    self._save_revocations()
                framed.max_recv_frame_bytes = core.max_frame_bytes(client.conn_id)
                self._wake()
                delay_ns = core.read_delay_ns(client.conn_id, time.monotonic_ns())
                if delay_ns > 0:
                    self.read_pauses += 1
                    await asyncio.sleep(delay_ns / SECOND_NS)
        except FramingError as exc:
            registered = core.registered_node(client.conn_id) is not None
            core.stream_failed(client.conn_id, p.refusal_for_framing_error(exc, registered=registered))
            self._wake()
        except StreamError:
            pass

    async def _write_loop(self, client: _Client, framed: FramedStream) -> None:
        core = self.core
        last_refusal = ""
        try:
            while True:
                body = core.next_frame(client.conn_id)
                if body is None:
                    if core.is_closing(client.conn_id):
                        await self._flush_and_close(client, framed, last_refusal)
                        return
                    client.wake.clear()
                    await client.wake.wait()
                    continue
                if core.is_closing(client.conn_id):
                    refusal = _refusal_text(body)
                    if refusal and not self._closing:
                        client.registered = False  # this line says why it ends
                        self._log_refusal(client.link, refusal)
                    last_refusal = refusal or last_refusal
                await framed.send_frame(body)
        except StreamError:
            pass

    def _log_refusal(self, link: QuicLink, refusal: str) -> None:
        # A node retrying with the same mistake is said once (until its reason changes).
        repeated = self._last_refusal.pop(link.peer_id, None) == refusal
        self._last_refusal[link.peer_id] = refusal
        while len(self._last_refusal) > _REFUSALS_REMEMBERED:
            self._last_refusal.pop(next(iter(self._last_refusal)))
        level = logging.DEBUG if repeated else logging.INFO
        self._client_log.log(level, "refused %s: %s", _who(link), refusal)

    async def _flush_and_close(self, client: _Client, framed: FramedStream, reason: str) -> None:
        link = client.link
        framed.finish()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._flush_timeout):
                while not link.is_closed and link.quic.send_backlog(framed.stream.stream_id) > 0:
                    await link.progress.wait()
        link.close(reason or "closed by the relay")

    def _wake(self) -> None:
        for event in self.core.take_events():
            conn_id = event.conn_id
            client = self._by_conn.get(conn_id)
            if client is None:
                continue
            client.wake.set()
            if client.close_timer is None and self.core.is_closing(conn_id):
                client.close_timer = asyncio.get_running_loop().call_later(
                    2 * self._flush_timeout, client.link.close, "closed by the relay (client not reading)"
                )

    def _on_timer(self, now_ns: int) -> None:
        self.core.handle_timer(now_ns)
        self._wake()

    async def _follow_address(self, client: _Client) -> None:
        """Tell the core each time the client's datagrams come from elsewhere (QUIC followed them)."""
        link = client.link
        while True:
            address = describe_sockaddr(link.current_address)
            if address != client.address:
                client.address = address
                self.core.address_changed(client.conn_id, address)
                self._wake()
            await link.moved.wait()


def _who(link: QuicLink) -> str:
    """``node 4ceybayaat4r at 192.0.2.7:50123``."""
    return f"node {short_id(link.peer_id)} at {describe_sockaddr(link.current_address)}"


def _refusal_text(body: bytes) -> str:
    try:
        message = p.decode_server_message(body)
    except p.RelayRefused:
        return ""
    if message.WhichOneof("kind") != "refused":
        return ""
    return str(p.RelayRefused.from_pb(message.refused))[:100]


__all__ = ["RelayServer", "load_relay_identity"]
