"""TLS 1.3 over TCP between two nodes, authenticated both ways with their node keys: the bulk lane.

aioquic does its per-packet work in Python, which caps a QUIC link at tens of MB/s; on
TCP the kernel and OpenSSL do the per-byte work. A lane connection carries one stream,
exactly what a QUIC stream carries (a type byte, then frames), so the handlers that
serve QUIC streams serve it unchanged; it is opened for one request and closed after it.

Authentication is the QUIC links' (:mod:`meshnode.transport.node_certificate` says how
OpenSSL is made to do it): each side shows a certificate carrying its node key, the
client accepts only the node it dialed, the server only nodes it trusts, and after the
handshake both read the peer's node id out of its certificate. Nothing else is trusted.

TLS on an asyncio transport cannot half-close, so :meth:`TlsStream.finish` writes no end
of stream: the protocols carried here do not need one (a request is one frame), and the
server ends the connection when its reply is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
import tempfile
from collections.abc import Iterable
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


class TlsStream(MeshStream):
    """One lane connection as a :class:`MeshStream` to an authenticated peer."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer_id: bytes,
        read_limits: ReadLimits | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.peer_id = peer_id
        self.read_limits = read_limits
        self._id = next(_stream_ids)
        self._send_error: StreamError | None = None
        self._recv_error: StreamError | None = None

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
        try:
            return await self._reader.read(max_bytes)
        except (ConnectionError, ssl.SSLError) as exc:
            raise LinkClosed(f"lane connection lost: {exc}") from None

    async def write(self, data: bytes) -> None:
        if self._send_error is not None:
            raise self._send_error
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, ssl.SSLError) as exc:
            raise LinkClosed(f"lane connection lost: {exc}") from None

    def finish(self) -> None:
        # No end of stream on the wire (see the module's note); later writes are refused here.
        if self._send_error is None:
            self._send_error = StreamError("write after finish")

    def reset(self, error_code: int) -> None:
        # TCP carries no reset code, but it can say "aborted" apart from "done": an RST, which the
        # peer reads as a lost connection (a source that failed), never as a clean end of reply.
        self._send_error = self._recv_error = StreamReset(error_code, by_peer=False)
        abort_with_reset(self._writer)

    def close(self) -> None:
        # What was written still goes out before the connection closes.
        self.finish()
        if self._recv_error is None:
            self._recv_error = StreamError("stream closed")
        self._writer.close()


async def dial_lane(
    host: str,
    port: int,
    contexts: LaneContexts,
    expected_peer_id: bytes,
    *,
    timeout: float,
    read_limits: ReadLimits | None = None,
) -> TlsStream:
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
    return TlsStream(reader, writer, peer_id, read_limits)


__all__ = [
    "LANE_ALPN",
    "LANE_DIAL_FAILURES",
    "LaneContexts",
    "LaneDialError",
    "TlsStream",
    "abort_with_reset",
    "authenticated_peer",
    "dial_lane",
]
