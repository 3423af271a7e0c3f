"""QUIC links over one UDP socket: ALPN ``mesh-llm/1``, mutual Ed25519 authentication.

One :class:`QuicEndpoint` owns one UDP socket and serves both directions: it
accepts connections and dials from the same port (so the address a node
advertises is the address its dials come from). Datagrams are routed to
connections by destination connection id, as aioquic's own server does.

Backpressure: ``write`` waits while the stream has more than
``max_stream_backlog`` or the connection more than ``max_connection_backlog``
bytes written but not acknowledged; the receiver grants credit only for what its
application read (see :mod:`meshnode.transport.quic_connection`). What a link's
readers hold of incomplete frames is capped per link and per process, and a
reader waiting mid-frame gives up after a stall timeout (see
:mod:`meshnode.transport.read_limits`). Keepalive PINGs go out every
``keepalive_interval`` (below the 30 s UDP NAT timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
from typing import cast

from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from meshnode.identity import NodeIdentity, short_id
from meshnode.sansio import SECOND_NS
from meshnode.timer_edge import TimerEdge
from meshnode.transport.addresses import parse_host_port
from meshnode.transport.base import LinkClosed, LinkHandler, MeshStream, PeerLink, StreamError, StreamReset
from meshnode.transport.bind_errors import listen_error
from meshnode.transport.buffers import Progress, ReceiveBuffer
from meshnode.transport.credited_stream import CreditedStream
from meshnode.transport.quic_config import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfig
from meshnode.transport.quic_connection import MeshQuicConnection, quic_configuration, self_signed_certificate
from meshnode.transport.read_limits import ReadLimits, process_budget
from meshnode.transport.udp_address import FamilyMismatch, SockAddr, describe_sockaddr, sockaddr_for
from meshnode.wire.buffer_budget import BufferBudget

log = logging.getLogger(__name__)

_WRITE_CHUNK = 256 * 1024
_MAX_CONCURRENT_RESOLVES = 4
# QUIC error code for application-initiated closes that carry a reason phrase.
_CLOSE_APPLICATION = 0x0


class DialError(ConnectionError):
    pass


class PeerKeyMismatch(DialError):
    """The dialed address answered with another node's key than the one we were told to expect."""

    def __init__(self, presented: bytes, expected: bytes) -> None:
        super().__init__(f"peer key {short_id(presented)} is not the expected node {short_id(expected)}")
        self.presented = presented
        self.expected = expected


class PeerStreamIds:
    """The peer-opened bidirectional stream ids a link has seen: every id below ``next_unseen``,
    plus those in ``seen_ahead`` (streams can surface out of order after loss). Memory stays
    bounded by the peer's stream limit."""

    def __init__(self, first: int) -> None:
        self.next_unseen = first
        self.seen_ahead: set[int] = set()

    def first_sight(self, stream_id: int) -> bool:
        """True once per peer stream."""
        if stream_id < self.next_unseen or stream_id in self.seen_ahead:
            return False
        self.seen_ahead.add(stream_id)
        while self.next_unseen in self.seen_ahead:
            self.seen_ahead.remove(self.next_unseen)
            self.next_unseen += 4
        return True


class QuicMeshStream(CreditedStream):
    _link: QuicLink

    def __init__(self, link: QuicLink, stream_id: int) -> None:
        self._link = link
        self._id = stream_id
        self.peer_id = link.peer_id
        self.read_limits = link.read_limits
        self.recv = ReceiveBuffer()
        self.send_error: Exception | None = None
        self.recv_done = False

    @property
    def stream_id(self) -> int:
        return self._id

    async def read(self, max_bytes: int = 65536) -> bytes:
        data = await self.recv.read(max_bytes)
        if data:
            self._link.consumed(self._id, len(data))
        elif self.recv.at_eof:
            self._link.maybe_forget(self)
        return data

    def _send_credit(self) -> int:
        # aioquic buffers without bound, so the credit is what the unacknowledged backlogs allow.
        link = self._link
        if (
            link.quic.send_backlog(self._id) >= link.settings.max_stream_backlog
            or link.connection_backlog() >= link.settings.max_connection_backlog
        ):
            return 0
        unsent_cap = link.settings.max_stream_unsent
        if unsent_cap is not None:
            return max(0, min(_WRITE_CHUNK, unsent_cap - link.quic.send_unsent(self._id)))
        return _WRITE_CHUNK

    def _send_piece(self, piece: memoryview) -> None:
        self._link.quic.send_stream_data(self._id, bytes(piece))
        self._link.transmit_soon()

    def finish(self) -> None:
        if self.send_error is not None or self._link.is_closed:
            return
        self.send_error = StreamError("write after finish")
        self._link.quic.send_stream_data(self._id, b"", end_stream=True)
        self._link.transmit_soon()
        self._link.maybe_forget(self)

    def close(self) -> None:
        link = self._link
        self.finish()
        if link.is_closed:
            return
        if not self.recv_done:
            with contextlib.suppress(ValueError):
                link.quic.stop_stream(self._id, 0)
            link.transmit_soon()
        link.dropped(self, self.recv.fail(StreamError("stream closed")))
        self.recv_done = True
        link.maybe_forget(self)

    def reset(self, error_code: int) -> None:
        link = self._link
        if link.is_closed:
            return
        if self.send_error is None or not isinstance(self.send_error, StreamReset):
            # ValueError: already fully acknowledged and discarded, nothing to abort.
            with contextlib.suppress(ValueError):
                link.quic.reset_stream(self._id, error_code)
        if not self.recv_done:
            # ValueError: the peer never sent on it.
            with contextlib.suppress(ValueError):
                link.quic.stop_stream(self._id, error_code)
        self.send_error = StreamReset(error_code, by_peer=False)
        link.dropped(self, self.recv.fail(StreamReset(error_code, by_peer=False)))
        self.recv_done = True
        link.progress.notify()
        link.transmit_soon()
        link.maybe_forget(self)


class QuicLink(PeerLink):
    def __init__(
        self,
        endpoint: QuicEndpoint,
        quic: MeshQuicConnection,
        *,
        initiated_locally: bool,
        expected_peer_id: bytes | None,
        remote_address: SockAddr,
        settings: QuicConfig | None = None,
        handler: LinkHandler | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.quic = quic
        # A relay registration shares the node's socket with its own ALPN, timeouts and owner.
        self.settings = settings or endpoint.settings
        self.handler = handler or endpoint.handler
        self.initiated_locally = initiated_locally
        self.expected_peer_id = expected_peer_id
        self.remote_address = remote_address
        self.peer_id = b""
        self.established_at = 0.0
        self.last_received_at = endpoint.loop.time()
        self.created_at = self.last_received_at
        self.progress = Progress()
        # Wakes whoever follows where the peer's datagrams come from (current_address) when it moves.
        self.moved = Progress()
        self._peer_address = remote_address
        self.read_limits = ReadLimits(
            budget=endpoint.process_budget.child(self.settings.frame_buffer_per_connection),
            stall_timeout=self.settings.frame_stall_timeout,
        )
        self.close_reason = ""
        self.connected: asyncio.Future[None] = endpoint.loop.create_future()
        self._closed = asyncio.Event()
        self._terminated = False
        self._streams: dict[int, QuicMeshStream] = {}
        self.peer_streams = PeerStreamIds(first=1 if initiated_locally else 0)
        self._timer = TimerEdge(self._quic_timer_ns, self._handle_timer, clock=self._loop_clock_ns)
        self._transmit_handle: asyncio.Handle | None = None
        # UDP payload bytes each way (status and metrics: direct against relayed traffic).
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- PeerLink --------------------------------------------------------------

    async def open_raw_stream(self) -> MeshStream:
        if self.is_closed:
            raise LinkClosed(self.close_reason)
        stream_id = self.quic.get_next_available_stream_id()
        # aioquic hands out the same id until the stream exists; an empty write creates it.
        self.quic.send_stream_data(stream_id, b"")
        stream = QuicMeshStream(self, stream_id)
        self._streams[stream_id] = stream
        return stream

    def close(self, reason: str = "") -> None:
        if self.is_closed:
            return
        self.quic.close(error_code=_CLOSE_APPLICATION, reason_phrase=reason[:100])
        self.transmit()
        self._mark_closed(reason or "closed")

    @property
    def description(self) -> str:
        return f"quic {describe_sockaddr(self.remote_address)}"

    @property
    def current_address(self) -> SockAddr:
        """Where the peer's datagrams come from now: QUIC follows a peer whose address changed
        (a NAT that remapped it), ``remote_address`` is where the link began. ``moved`` wakes its
        waiters when it changes."""
        return self.quic.get_peer_address() or self.remote_address

    @property
    def stream_count(self) -> int:
        """Streams the link still tracks (a stream is forgotten once both its directions are done)."""
        return len(self._streams)

    # -- used by streams ------------------------------------------------------

    def connection_backlog(self) -> int:
        backlog = self.quic.send_backlog
        return sum(backlog(stream_id) for stream_id in self._streams)

    def consumed(self, stream_id: int, nbytes: int) -> None:
        if self.quic.note_consumed(stream_id, nbytes):
            self.transmit_soon()

    def dropped(self, stream: QuicMeshStream, nbytes: int) -> None:
        if nbytes:
            self.consumed(stream.stream_id, nbytes)

    def maybe_forget(self, stream: QuicMeshStream) -> None:
        if stream.send_error is not None and (stream.recv_done and stream.recv.size == 0):
            self._streams.pop(stream.stream_id, None)
            self.quic.forget_stream(stream.stream_id)

    def transmit_soon(self) -> None:
        if self._transmit_handle is None:
            self._transmit_handle = self.endpoint.loop.call_soon(self.transmit)

    # -- driven by the endpoint -------------------------------------------------

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.last_received_at = self.endpoint.loop.time()
        self.bytes_received += len(data)
        self.quic.receive_datagram(data, addr, now=self.last_received_at)
        self._notice_move()
        self._process_events()
        # Not at once: the datagrams read in this loop turn, and the answers the woken
        # readers write, leave together in one pass (fewer packets, ACKs ride on data).
        self.transmit_soon()

    def transmit(self) -> None:
        self._transmit_handle = None
        loop = self.endpoint.loop
        sent = False
        for data, addr in self.quic.datagrams_to_send(now=loop.time()):
            self.endpoint.sendto(data, addr)
            self.bytes_sent += len(data)
            sent = True
        if sent and self.settings.max_stream_unsent is not None:
            # What was waiting to be sent went: writers held back by max_stream_unsent re-check.
            self.progress.notify()
        self._timer.rearm()

    def ping(self) -> None:
        self.quic.send_ping(0)
        self.transmit()

    def _loop_clock_ns(self) -> int:
        return round(self.endpoint.loop.time() * SECOND_NS)

    def _quic_timer_ns(self) -> int | None:
        # aioquic's times are the loop's clock in float seconds (every datagram is stamped with
        # loop.time()), so its timer runs on that clock too. Rounded up, so that the time handed
        # back is never before aioquic's own.
        timer_at = self.quic.get_timer()
        return None if timer_at is None else math.ceil(timer_at * SECOND_NS)

    def _handle_timer(self, now_ns: int) -> None:
        self.quic.handle_timer(now=now_ns / SECOND_NS)
        self._notice_move()  # a path validation that timed out goes back to the previous address
        self._process_events()
        self.transmit()

    def _notice_move(self) -> None:
        address = self.current_address
        if address != self._peer_address:
            self._peer_address = address
            self.moved.notify()

    def _process_events(self) -> None:
        event = self.quic.next_event()
        while event is not None:
            self._handle_event(event)
            event = self.quic.next_event()
        # Acks may have shrunk send backlogs; writers re-check.
        self.progress.notify()

    def _handle_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.StreamDataReceived):
            stream = self._stream_for(event.stream_id)
            if stream is None:
                return
            if event.data and stream.recv.error is None:
                stream.recv.feed(event.data)
                self.quic.app_unread += len(event.data)
            if event.end_stream:
                stream.recv.feed_eof()
                stream.recv_done = True
                self.maybe_forget(stream)
        elif isinstance(event, events.StreamReset):
            stream = self._stream_for(event.stream_id)
            if stream is not None:
                self.dropped(stream, stream.recv.fail(StreamReset(event.error_code)))
                stream.recv_done = True
                self.maybe_forget(stream)
        elif isinstance(event, events.StopSendingReceived):
            stream = self._stream_for(event.stream_id)
            if stream is not None and stream.send_error is None:
                stream.send_error = StreamReset(event.error_code)
                self.maybe_forget(stream)
        elif isinstance(event, events.HandshakeCompleted):
            self._authenticate(event)
        elif isinstance(event, events.ConnectionIdIssued):
            self.endpoint.route(event.connection_id, self)
        elif isinstance(event, events.ConnectionIdRetired):
            self.endpoint.unroute(event.connection_id)
        elif isinstance(event, events.ConnectionTerminated):
            self._terminated = True
            self._mark_closed(
                self.close_reason or f"closed by peer: {event.reason_phrase or event.error_code}"
            )
            self.endpoint.forget(self)

    def _stream_for(self, stream_id: int) -> QuicMeshStream | None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        client_initiated = stream_id & 1 == 0
        peer_initiated = client_initiated != self.initiated_locally
        if not peer_initiated or self.is_closed:
            return None  # one of ours, already forgotten
        if stream_id & 2 or not self.peer_id:
            self.quic.stop_stream(stream_id, 0)  # mesh-llm/1 has no unidirectional streams
            return None
        if not self.peer_streams.first_sight(stream_id):
            return None  # served and forgotten already
        stream = QuicMeshStream(self, stream_id)
        self._streams[stream_id] = stream
        self.streams_accepted += 1
        self.handler.stream_accepted(self, stream)
        return stream

    def _authenticate(self, event: events.HandshakeCompleted) -> None:
        peer_key = self.quic.peer_public_key()
        if event.alpn_protocol != self.settings.alpn:
            self._refuse(f"peer did not negotiate ALPN {self.settings.alpn}")
        elif peer_key is None:
            self._refuse("peer presented no Ed25519 certificate")
        elif self.expected_peer_id is not None and peer_key != self.expected_peer_id:
            self._refuse(PeerKeyMismatch(peer_key, self.expected_peer_id))
        else:
            self.peer_id = peer_key
            self.established_at = self.endpoint.loop.time()
            if not self.connected.done():
                self.connected.set_result(None)
            self.handler.link_established(self)

    def _refuse(self, reason: str | DialError) -> None:
        error = reason if isinstance(reason, DialError) else DialError(reason)
        # Our own dial's caller reports the failure (once per reason, where it retries);
        # a connection that came in has only this line.
        level = logging.DEBUG if self.initiated_locally else logging.INFO
        log.log(level, "refused QUIC connection from %s: %s", describe_sockaddr(self.remote_address), error)
        if not self.connected.done():
            self.connected.set_exception(error)
            self.connected.exception()  # mark retrieved: dials await it, accepts do not
        self.close(str(error))

    def _mark_closed(self, reason: str) -> None:
        if self.is_closed:
            if self._terminated:
                self._cancel_timer()
            return
        self.close_reason = reason
        self._closed.set()
        for stream in list(self._streams.values()):
            stream.send_error = stream.send_error or LinkClosed(reason)
            self.dropped(stream, stream.recv.fail(LinkClosed(reason)))
            stream.recv_done = True
        self._streams.clear()
        self.progress.notify()
        if not self.connected.done():
            self.connected.set_exception(DialError(reason))
            self.connected.exception()
        if self.peer_id:
            self.handler.link_closed(self, reason)
        if self._terminated:
            self._cancel_timer()

    def _cancel_timer(self) -> None:
        self._timer.cancel()


class QuicEndpoint(asyncio.DatagramProtocol):
    """One UDP socket: accepts connections and dials peers."""

    def __init__(self, identity: NodeIdentity, handler: LinkHandler, settings: QuicConfig) -> None:
        self.identity = identity
        self.handler = handler
        self.settings = settings
        # Shared with every other endpoint of the process unless a test swaps it.
        self.process_budget: BufferBudget = process_budget()
        self.loop = asyncio.get_running_loop()
        self._certificate = self_signed_certificate(identity)
        self._server_config = self._configuration(settings, is_client=False)
        # Client configurations by the settings dialed with (the node's own, a relay's).
        self._client_configs: dict[QuicConfig, QuicConfiguration] = {}
        # UDP payload bytes of links gone, by ALPN (see traffic()).
        self._traffic_gone: dict[str, list[int]] = {}
        self._by_cid: dict[bytes, QuicLink] = {}
        self._links: set[QuicLink] = set()
        self._transport: asyncio.DatagramTransport | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._family = socket.AF_INET
        self._socket_closed = asyncio.Event()
        self._resolving = asyncio.Semaphore(_MAX_CONCURRENT_RESOLVES)

    @classmethod
    async def listen(
        cls,
        identity: NodeIdentity,
        handler: LinkHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        settings: QuicConfig | None = None,
    ) -> QuicEndpoint:
        endpoint = cls(identity, handler, settings or QuicConfig())
        loop = asyncio.get_running_loop()
        try:
            await loop.create_datagram_endpoint(lambda: endpoint, local_addr=(host, port))
        except OSError as exc:
            raise listen_error("UDP", host, port, exc) from exc
        endpoint._housekeeping = loop.create_task(endpoint._housekeep())
        return endpoint

    @property
    def local_address(self) -> tuple[str, int]:
        assert self._transport is not None
        host, port = self._transport.get_extra_info("sockname")[:2]
        return host, port

    @property
    def links(self) -> set[QuicLink]:
        return set(self._links)

    def _configuration(self, settings: QuicConfig, *, is_client: bool) -> QuicConfiguration:
        return quic_configuration(
            self.identity,
            self._certificate,
            is_client=is_client,
            stream_window=settings.stream_window,
            connection_window=settings.connection_window,
            idle_timeout=settings.idle_timeout,
            max_datagram_size=settings.max_datagram_size,
            alpn=settings.alpn,
        )

    def can_dial(self, address: str) -> bool:
        """Whether this socket can send to ``address``: an IPv6 literal needs an IPv6 socket, and
        a socket bound to loopback reaches only loopback (a name is taken to resolve to an
        address it can reach)."""
        try:
            host, port = parse_host_port(address)
            sockaddr_for(self._family, host, port)
            target_loopback = ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
        except FamilyMismatch:
            return False
        except ValueError:
            return True
        bound = self.local_address[0]
        return target_loopback or not ipaddress.ip_address(bound.split("%", 1)[0]).is_loopback

    async def dial(
        self,
        address: str,
        expected_peer_id: bytes,
        timeout: float | None = None,
        *,
        settings: QuicConfig | None = None,
        handler: LinkHandler | None = None,
    ) -> QuicLink:
        """Connect to ``host:port`` and authenticate it as ``expected_peer_id``.

        ``settings`` and ``handler`` (default: the endpoint's) serve another protocol from the
        same socket: a relay registration leaves from the port peers see, so the address the
        relay observes is one they can reach.
        """
        if self._transport is None or self._transport.is_closing():
            raise DialError("endpoint closed")
        addr = await self._resolve(address)
        settings = settings or self.settings
        configuration = self._client_configs.get(settings)
        if configuration is None:
            configuration = self._client_configs[settings] = self._configuration(settings, is_client=True)
        quic = MeshQuicConnection(
            configuration=configuration,
            stream_window=settings.stream_window,
            connection_window=settings.connection_window,
            ack_delay=settings.ack_delay,
            peer_max_ack_delay=settings.peer_max_ack_delay,
        )
        link = QuicLink(
            self,
            quic,
            initiated_locally=True,
            expected_peer_id=expected_peer_id,
            remote_address=addr,
            settings=settings,
            handler=handler,
        )
        self._links.add(link)
        self.route(quic.host_cid, link)
        quic.connect(addr, now=self.loop.time())
        link.transmit()
        try:
            await asyncio.wait_for(asyncio.shield(link.connected), timeout or settings.handshake_timeout)
        except TimeoutError:
            link.close("handshake timed out")
            raise DialError(f"no QUIC handshake with {address} in time") from None
        except DialError:
            raise
        return link

    async def _resolve(self, address: str) -> SockAddr:
        """The address to dial ``address`` at, as this endpoint's socket reports its peers."""
        host, port = parse_host_port(address)
        try:
            return sockaddr_for(self._family, host, port)
        except FamilyMismatch as exc:
            raise DialError(f"cannot dial {address}: {exc}") from None
        except ValueError:
            pass  # a name, not an IP literal
        # An IPv4-only socket can use only A records; a dual-stack one either kind.
        family = socket.AF_INET if self._family == socket.AF_INET else socket.AF_UNSPEC
        # getaddrinfo runs in the default executor and cannot be cancelled: bound how
        # many names (announced by peers, possibly bogus) can tie it up at once.
        try:
            async with self._resolving, asyncio.timeout(self.settings.handshake_timeout):
                infos = await self.loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
        except (OSError, TimeoutError) as exc:
            raise DialError(f"cannot resolve {address}: {exc or type(exc).__name__}") from None
        if not infos:
            raise DialError(f"cannot resolve {address}: no address")
        # IPv4 first: a node listens on 0.0.0.0 by default, which an AAAA record cannot reach.
        first = min(infos, key=lambda info: info[0] != socket.AF_INET)
        return sockaddr_for(self._family, str(first[4][0]), port)

    def close(self) -> None:
        for link in list(self._links):
            link.close("node shutting down")
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        if self._transport is not None:
            # Let the CONNECTION_CLOSE datagrams queued above leave first.
            self.loop.call_soon(self._transport.close)
        else:
            self._socket_closed.set()

    async def wait_closed(self, timeout: float = 2.0) -> None:
        """After :meth:`close`: until the socket is closed and its port free to bind again
        (the event loop closes it a few turns later; Python 3.13's waits for queued sends)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._socket_closed.wait()

    # -- routing ---------------------------------------------------------------

    def route(self, cid: bytes, link: QuicLink) -> None:
        self._by_cid[cid] = link

    def unroute(self, cid: bytes) -> None:
        self._by_cid.pop(cid, None)

    def forget(self, link: QuicLink) -> None:
        if link in self._links:
            gone = self._traffic_gone.setdefault(link.settings.alpn, [0, 0])
            gone[0] += link.bytes_sent
            gone[1] += link.bytes_received
        self._links.discard(link)
        for cid in [cid for cid, owner in self._by_cid.items() if owner is link]:
            del self._by_cid[cid]

    def send_datagram(self, address: str, data: bytes) -> bool:
        """Send ``data`` from this socket to ``address`` (an IP literal ``host:port``: nothing is
        resolved); False where it cannot be sent."""
        try:
            host, port = parse_host_port(address)
            addr = sockaddr_for(self._family, host, port)
        except ValueError:  # not host:port, not an IP literal, or a family this socket lacks
            return False
        self.sendto(data, addr)
        return True

    def traffic(self, alpn: str) -> tuple[int, int]:
        """UDP payload bytes (sent, received) of every link of protocol ``alpn`` this endpoint
        has had, live and gone."""
        sent, received = self._traffic_gone.get(alpn, [0, 0])
        for link in self._links:
            if link.settings.alpn == alpn:
                sent += link.bytes_sent
                received += link.bytes_received
        return sent, received

    def sendto(self, data: bytes, addr: SockAddr) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(data, addr)

    # -- asyncio.DatagramProtocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            self._family = sock.family

    def connection_lost(self, exc: Exception | None) -> None:
        self._socket_closed.set()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            header = pull_quic_header(
                Buffer(data=data), host_cid_length=self._server_config.connection_id_length
            )
        except ValueError:
            return
        link = self._by_cid.get(header.destination_cid)
        if link is None:
            if (
                header.packet_type != QuicPacketType.INITIAL
                or len(data) < SMALLEST_MAX_DATAGRAM_SIZE
                or header.version not in self._server_config.supported_versions
                or len(self._links) >= self.settings.max_links
            ):
                return
            quic = MeshQuicConnection(
                configuration=self._server_config,
                original_destination_connection_id=header.destination_cid,
                stream_window=self.settings.stream_window,
                connection_window=self.settings.connection_window,
                ack_delay=self.settings.ack_delay,
                peer_max_ack_delay=self.settings.peer_max_ack_delay,
            )
            link = QuicLink(
                self, quic, initiated_locally=False, expected_peer_id=None, remote_address=addr[:2]
            )
            self._links.add(link)
            self.route(header.destination_cid, link)
            self.route(quic.host_cid, link)
        link.datagram_received(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP errors (port unreachable) say nothing reliable; liveness is probed.
        log.debug("UDP error: %s", exc)

    async def _housekeep(self) -> None:
        """Keepalive PINGs, and closing handshakes that never finish."""
        while True:
            # Every link's settings are looked at: a relay registration's keepalive is its own.
            intervals = [min(s.keepalive_interval, s.handshake_timeout) for s in self._link_settings()]
            await asyncio.sleep(min(intervals) / 2)
            now = self.loop.time()
            for link in list(self._links):
                if link.is_closed:
                    continue
                if not link.peer_id:
                    if now - link.created_at > link.settings.handshake_timeout:
                        link.close("handshake timed out")
                elif now - link.last_received_at >= link.settings.keepalive_interval:
                    link.ping()

    def _link_settings(self) -> set[QuicConfig]:
        return {self.settings, *(link.settings for link in self._links)}


__all__ = [
    "DialError",
    "PeerKeyMismatch",
    "PeerStreamIds",
    "QuicConfig",
    "QuicEndpoint",
    "QuicLink",
    "QuicMeshStream",
]
