"""TLS 1.3 over TCP between two nodes, authenticated both ways with their node keys: the bulk lane.

aioquic does its per-packet work in Python, which caps a QUIC link at tens of MB/s; on
TCP the kernel and OpenSSL do the per-byte work. A lane connection carries exchanges one
after another, each exactly what one QUIC stream carries, so the handlers that serve QUIC
streams serve it unchanged:

    exchange   = type byte, request frame, reply frames
    frame      = 4-byte little-endian length, body   (meshnode.wire.framing, 8 MiB cap)

The client sends an exchange's type byte and request, reads the reply to its end (the
reply's own last frame says so: a manifest, a refusal, an end marker), and only then
may send the next exchange on the same connection. The server reads the next type byte
only once its reply ended cleanly. Anything else ends the connection, never an exchange
alone: an exchange aborted on either side closes it (with a TCP RST where it is a reset,
:meth:`TlsStream.reset`), and so do bytes of a next request that arrive before the reply
ended. A connection is one :class:`LaneConnection`; each exchange on it is a
:class:`TlsStream`, which :meth:`TlsStream.release` hands back (a clean end: the
connection may carry the next exchange) or :meth:`TlsStream.close` ends with the
connection. Waiting idle for the next exchange is bounded on both sides (the client's
pool, :mod:`meshnode.transport.lane_pool`, gives up on an idle connection before the
server does, so that it never sends a request into a connection being closed).

Authentication is the QUIC links' (:mod:`meshnode.transport.node_certificate` says how
OpenSSL is made to do it): each side shows a certificate carrying its node key, the
client accepts only the node it dialed, the server only nodes it trusts, and after the
handshake both read the peer's node id out of its certificate. Nothing else is trusted.

TLS on an asyncio transport cannot half-close, so :meth:`TlsStream.finish` writes no end
of stream: the protocols carried here do not need one (a request is one frame, and a
reply says where it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from meshnode.identity import NodeIdentity, short_id
from meshnode.transport.node_certificate import certificate_node_id, lane_certificate, trust_anchor
from meshnode.transport.read_limits import ReadLimits
from meshnode.transport.stream import LinkClosed, MeshStream, StreamError, StreamReset

LANE_ALPN = "meshnode-bulk/1"
# What the stream reader holds before it stops reading the socket: a few chunk frames.
READ_BUFFER_BYTES = 1 << 20
# Failures of a dial: refused or unreachable (OSError), no handshake in time, a handshake
# that failed or a peer that is not the node dialed (LaneDialError).
LANE_DIAL_FAILURES: tuple[type[Exception], ...] = (OSError, TimeoutError, ssl.SSLError)
_stream_ids = itertools.count(1)


class LaneDialError(ConnectionError):
    """The lane's handshake completed with something other than the node we expected."""


class LaneContexts:
    """The TLS contexts of one node's bulk lane: one to serve with, one per peer it dials.

    The server context trusts the nodes passed to :meth:`trust` (OpenSSL drops any other
    client during the handshake, before the node spends more on it); trust only grows, and
    admission is checked again, by the listener, once the peer is known.
    """

    def __init__(self, identity: NodeIdentity) -> None:
        self.identity = identity
        self._certificate = lane_certificate(identity)
        self.server = self._context(ssl.PROTOCOL_TLS_SERVER)
        self._trusted: set[bytes] = set()
        self._clients: dict[bytes, ssl.SSLContext] = {}

    def trust(self, node_ids: Iterable[bytes]) -> None:
        """Let these nodes complete a handshake with the server context."""
        for node_id in node_ids:
            if node_id not in self._trusted:
                self.server.load_verify_locations(cadata=_der(trust_anchor(node_id)))
                self._trusted.add(node_id)

    def client(self, expected_peer_id: bytes) -> ssl.SSLContext:
        """A context that completes a handshake with ``expected_peer_id`` and nobody else."""
        context = self._clients.get(expected_peer_id)
        if context is None:
            context = self._context(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(cadata=_der(trust_anchor(expected_peer_id)))
            self._clients[expected_peer_id] = context
        return context

    def _context(self, protocol: ssl._SSLMethod) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # The peer is named by its key, never by a host name.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols([LANE_ALPN])
        _load_chain(context, self._certificate, self.identity)
        return context


def _der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def _load_chain(context: ssl.SSLContext, certificate: x509.Certificate, identity: NodeIdentity) -> None:
    # ssl loads a key only from a file: one in a private directory, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="meshnode-lane-") as directory:
        cert_path, key_path = Path(directory, "cert.pem"), Path(directory, "key.pem")
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.touch(mode=0o600)
        key_path.write_bytes(
            identity.private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        context.load_cert_chain(cert_path, key_path)


def authenticated_peer(writer: asyncio.StreamWriter) -> bytes:
    """The node id the completed handshake on ``writer`` authenticated; LaneDialError if none."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        raise LaneDialError("no TLS on the connection")
    if ssl_object.selected_alpn_protocol() != LANE_ALPN:
        raise LaneDialError(f"peer did not negotiate ALPN {LANE_ALPN}")
    der = ssl_object.getpeercert(binary_form=True)
    node_id = certificate_node_id(x509.load_der_x509_certificate(der)) if der else None
    if node_id is None:
        raise LaneDialError("peer presented no Ed25519 certificate")
    return node_id


def abort_with_reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection at once with a TCP RST (a plain close sends FIN, which reads as an end)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class LaneConnection:
    """One authenticated lane connection, carrying one exchange (a :class:`TlsStream`) at a time."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer_id: bytes,
        read_limits: ReadLimits | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.peer_id = peer_id
        self.read_limits = read_limits
        # Exchanges begun on it (tests and logs).
        self.exchanges = 0

    @property
    def usable(self) -> bool:
        """Whether it may carry another exchange: not closing, not ended or failed by the peer."""
        reader = self.reader
        return not (self.writer.transport.is_closing() or reader.at_eof() or reader.exception() is not None)

    def stream(
        self,
        on_release: Callable[[LaneConnection], None] | None = None,
        *,
        unread: bytes = b"",
        redial: Redial | None = None,
    ) -> TlsStream:
        """The next exchange on this connection; ``unread``: its first bytes, already read.

        ``redial`` (a client reusing an idle connection): if the peer turns out to have closed
        this connection before any byte of the reply came, the request is sent again on a new
        connection from ``redial`` (see :class:`TlsStream`)."""
        self.exchanges += 1
        return TlsStream(self, on_release, unread, redial)

    async def next_exchange(self, idle_timeout: float) -> bytes:
        """The first byte of the peer's next exchange; ``b""`` when the peer ended the connection
        or sent nothing for ``idle_timeout`` seconds."""
        try:
            async with asyncio.timeout(idle_timeout):
                return await self.reader.read(1)
        except (TimeoutError, ConnectionError, ssl.SSLError):
            return b""

    def close(self) -> None:
        """End the connection; what was written still goes out first."""
        self.writer.close()

    def abort(self) -> None:
        abort_with_reset(self.writer)


Redial = Callable[[], Awaitable[LaneConnection]]
# What a stream that may be sent again keeps of what it wrote: a request is a few hundred bytes.
_REPLAY_BYTES = 64 * 1024
# Writes shorter than this (a type byte, a frame's length prefix, a small frame) wait for the
# stream's next write, so that a request, a chunk frame, or a small tensor's one chunk and the
# end of its reply go out in one flush and one send, not two; short pieces go out joined, as one
# TLS record. Held writes go out at the latest when the stream reads, finishes, or ends.
_HOLD_BYTES = 16 * 1024


class TlsStream(MeshStream):
    """One exchange on a lane connection, as a :class:`MeshStream` to an authenticated peer.

    With ``redial``, on a reused connection: a server may close an idle connection just as the
    client reuses it, and then the request meets an end or a reset before any byte of the
    reply. That says nothing about the request, so it is sent once more, on a new connection
    (requests are idempotent reads); a reply that began is never replayed.
    """

    def __init__(
        self,
        connection: LaneConnection,
        on_release: Callable[[LaneConnection], None] | None = None,
        unread: bytes = b"",
        redial: Redial | None = None,
    ) -> None:
        self.connection = connection
        self._reader = connection.reader
        self._writer = connection.writer
        self.peer_id = connection.peer_id
        self.read_limits = connection.read_limits
        self._on_release = on_release
        self._unread = unread
        self._redial = redial
        # What was written while it may still be sent again (None: it may not).
        self._replay: bytearray | None = bytearray() if redial is not None else None
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._id = next(_stream_ids)
        self._send_error: StreamError | None = None
        self._recv_error: StreamError | None = None
        # Ended with release(): the connection went on to its next exchange.
        self.released = False

    # The stream reader holds this much before it stops reading the socket: a frame up to this
    # size waits there whole, so a reader may ask for it in one read.
    exact_read_bytes = READ_BUFFER_BYTES

    @property
    def stream_id(self) -> int:
        return self._id

    @property
    def description(self) -> str:
        host, port = self._writer.get_extra_info("peername")[:2]
        return f"tls {host}:{port}"

    async def read(self, max_bytes: int = 65536) -> bytes:
        if self._recv_error is not None:
            raise self._recv_error
        if self._unread:
            data, self._unread = self._unread[:max_bytes], self._unread[max_bytes:]
            return data
        self._send_held()
        try:
            data = await self._reader.read(max_bytes)
        except (ConnectionError, ssl.SSLError) as exc:
            if self._replay is None:
                raise LinkClosed(f"lane connection lost: {exc}") from None
            data = b""
        if not data and self._replay is not None:
            await self._send_again()
            return await self.read(max_bytes)
        # A byte of the reply came: this exchange stays on this connection, come what may.
        self._replay = None
        return data

    async def readexactly(self, nbytes: int) -> bytes:
        if self._recv_error is not None:
            raise self._recv_error
        if self._unread or self._replay is not None:
            # Bytes the listener read first, or a reply not begun whose request may go out again:
            # read() knows both (only the first read of an exchange meets them).
            return await self._read_pieces(nbytes)
        self._send_held()
        try:
            return await self._reader.readexactly(nbytes)
        except (ConnectionError, ssl.SSLError) as exc:
            raise LinkClosed(f"lane connection lost: {exc}") from None

    async def _read_pieces(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            piece = await self.read(nbytes - len(data))
            if not piece:
                raise asyncio.IncompleteReadError(data, nbytes)
            data += piece
        return data

    async def write(self, data: bytes) -> None:
        if self._send_error is not None:
            raise self._send_error
        if self._replay is not None:
            if len(self._replay) + len(data) > _REPLAY_BYTES:
                self._replay = None
            else:
                self._replay += data
        if len(data) < _HOLD_BYTES and self._held_bytes < _HOLD_BYTES:
            self._held.append(bytes(data))
            self._held_bytes += len(data)
            return
        pieces, joined = [*self._held, data], bool(self._held) and len(data) < _HOLD_BYTES
        self._held, self._held_bytes = [], 0
        try:
            if joined:
                self._writer.write(b"".join(pieces))
            else:
                self._writer.writelines(pieces)
            await self._writer.drain()
        except (ConnectionError, ssl.SSLError) as exc:
            if self._replay is None:
                raise LinkClosed(f"lane connection lost: {exc}") from None
            await self._send_again()

    def _send_held(self) -> None:
        if self._held:
            pieces, self._held, self._held_bytes = self._held, [], 0
            self._writer.write(b"".join(pieces))

    async def _send_again(self) -> None:
        """What was written, once more on a new connection (the peer closed this one unread)."""
        assert self._replay is not None and self._redial is not None
        written, self._replay = bytes(self._replay), None
        self._held, self._held_bytes = [], 0  # in what was written
        self.connection.close()
        try:
            connection = await self._redial()
        except LANE_DIAL_FAILURES as exc:
            raise LinkClosed(f"lane connection lost, and a new one failed: {exc}") from None
        connection.exchanges += 1
        self.connection, self._reader, self._writer = connection, connection.reader, connection.writer
        try:
            self._writer.write(written)
            await self._writer.drain()
        except (ConnectionError, ssl.SSLError) as exc:
            raise LinkClosed(f"lane connection lost: {exc}") from None

    def finish(self) -> None:
        # No end of stream on the wire (see the module's note); later writes are refused here.
        if self._send_error is None:
            self._send_held()
            self._send_error = StreamError("write after finish")

    def reset(self, error_code: int) -> None:
        # TCP carries no reset code, but it can say "aborted" apart from "done": an RST, which the
        # peer reads as a lost connection (a source that failed), never as a clean end of reply.
        if self.released:
            return
        self._send_error = self._recv_error = StreamReset(error_code, by_peer=False)
        self.connection.abort()

    def close(self) -> None:
        # The exchange did not end cleanly (or nobody says it did): the connection ends with it.
        # What was written still goes out before it closes.
        if self.released:
            return
        self.finish()
        if self._recv_error is None:
            self._recv_error = StreamError("stream closed")
        self.connection.close()

    def release(self) -> None:
        """The exchange ended cleanly: the connection may carry the next (given to ``on_release``);
        one that the peer ended or that failed meanwhile is closed instead."""
        if self.released or isinstance(self._recv_error, StreamReset):
            return
        if self._recv_error is not None or self._unread or not self.connection.usable:
            self.close()
            return
        self.finish()  # what is held goes out
        self.released = True
        self._send_error = self._recv_error = StreamError("exchange over: the connection went on")
        if self._on_release is not None:
            self._on_release(self.connection)


async def dial_lane(
    host: str,
    port: int,
    contexts: LaneContexts,
    expected_peer_id: bytes,
    *,
    timeout: float,
    read_limits: ReadLimits | None = None,
) -> LaneConnection:
    """A lane connection to ``expected_peer_id`` at ``host:port``; raises one of LANE_DIAL_FAILURES."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(
            host,
            port,
            ssl=contexts.client(expected_peer_id),
            server_hostname="meshnode",
            limit=READ_BUFFER_BYTES,
        )
    try:
        peer_id = authenticated_peer(writer)
        if peer_id != expected_peer_id:
            raise LaneDialError(
                f"peer key {short_id(peer_id)} is not the expected node {short_id(expected_peer_id)}"
            )
    except BaseException:
        abort_with_reset(writer)
        raise
    return LaneConnection(reader, writer, peer_id, read_limits)


__all__ = [
    "LANE_ALPN",
    "LANE_DIAL_FAILURES",
    "LaneConnection",
    "LaneContexts",
    "LaneDialError",
    "TlsStream",
    "abort_with_reset",
    "authenticated_peer",
    "dial_lane",
]
