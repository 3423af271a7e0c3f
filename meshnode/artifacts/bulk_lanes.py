"""Which lane each artifact source is fetched over: the bulk lane (TLS over TCP) or its QUIC link.

:class:`BulkLanes` stands in for ``node.get_link`` in :func:`~.fetcher.fetch_manifest` and
:func:`~.fetcher.fetch_tensors`. For a source the node reaches directly at an address the
peer listens on (:func:`lane_address`: a direct QUIC link at an address the peer announces,
or one this node dialed to a peer that says it is directly reachable), each ARTIFACT
stream is an exchange on a TLS connection to the same port number over TCP, authenticated
as that node: one from the source's :class:`~meshnode.transport.lane_pool.LanePool` of idle
connections when it has one, else a new one (a connection goes back to the pool only when
its reply was read to its end, see :mod:`meshnode.transport.tls_lane`).
A source reached only through a relay, or through a punched UDP path (its NAT's mapping,
which TCP cannot use), stays on QUIC; so does one whose lane cannot be dialed or whose
handshake fails, from then on. Either way the fetcher verifies every byte as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from meshnode.identity import short_id
from meshnode.transport.addresses import parse_host_port
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.lane_pool import LanePool
from meshnode.transport.quic import QuicLink
from meshnode.transport.tls_lane import LANE_DIAL_FAILURES, LaneConnection, LaneContexts, dial_lane
from meshnode.transport.udp_address import describe_sockaddr
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

GetLink = Callable[[bytes], Awaitable[PeerLink]]
# A lane that answers slower than this is treated as unreachable (the fetch goes over QUIC).
DEFAULT_CONNECT_TIMEOUT_S = 5.0


def lane_address(link: PeerLink, announcement: mesh.PeerAnnouncement | None) -> tuple[str, int] | None:
    """Where ``link``'s peer listens for lane connections, or ``None`` when TCP cannot reach it.

    Its QUIC socket's address, when the link is direct and that address is one the peer
    listens on: one it announces (a public address, or the same LAN), or one this node dialed
    when the peer says it is directly reachable. A relayed link and a punched path (from a NAT
    mapping the peer does not announce) give ``None``.
    """
    if not isinstance(link, QuicLink) or link.relay_id is not None:
        return None
    address = describe_sockaddr(link.remote_address)
    announced = announcement is not None and address in announcement.addresses
    dialed_public = link.initiated_locally and announcement is not None and announcement.directly_reachable
    if not (announced or dialed_public):
        return None
    return parse_host_port(address)


class BulkLanes:
    def __init__(
        self,
        get_link: GetLink,
        contexts: LaneContexts,
        address_of: Callable[[PeerLink], tuple[str, int] | None],
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        pool: LanePool | None = None,
    ) -> None:
        self._get_link = get_link
        self.contexts = contexts
        self._address_of = address_of
        self.connect_timeout = connect_timeout
        self.pool = pool if pool is not None else LanePool()
        # Per source, the lane its artifacts came over, in words (the log says it once).
        self.lanes: dict[bytes, str] = {}
        # Sources whose lane failed: QUIC only from then on.
        self._lane_failed: dict[bytes, str] = {}
        # Per source, the lane found for its current QUIC link: the fetcher asks for a link per
        # tensor, and the address comes from that link. Only a lane is remembered, so a source
        # that had none (its announcement not in yet, say) is looked at again next time.
        self._lane_links: dict[bytes, _LaneLink] = {}

    async def open_link(self, source: bytes) -> PeerLink:
        """What the fetcher opens ARTIFACT streams on for ``source`` (an ``OpenLink``)."""
        link = await self._get_link(source)
        if source in self._lane_failed:
            return link
        known = self._lane_links.get(source)
        if known is not None and known.quic is link:
            return known
        address = self._address_of(link)
        if address is None:
            self._note(source, f"QUIC ({link.description}: no direct address for TCP)")
            return link
        self._lane_links[source] = lane_link = _LaneLink(self, link, address)
        return lane_link

    def close(self) -> None:
        """Close the idle lane connections (those carrying an exchange close with it)."""
        self.pool.close()

    def lane_failed(self, source: bytes, address: tuple[str, int], reason: str) -> None:
        self._lane_failed[source] = reason
        self._lane_links.pop(source, None)
        log.warning(
            "bulk lane to %s at %s:%d failed (%s): its artifacts come over QUIC",
            short_id(source),
            *address,
            reason,
        )
        self._note(source, f"QUIC (bulk lane failed: {reason})")

    def lane_used(self, source: bytes, address: tuple[str, int]) -> None:
        self._note(source, f"TLS/TCP {address[0]}:{address[1]}")

    def _note(self, source: bytes, lane: str) -> None:
        if self.lanes.get(source) != lane:
            self.lanes[source] = lane
            log.info("artifacts from %s over %s", short_id(source), lane)


class _LaneLink(PeerLink):
    """A source's QUIC link whose streams are lane connections while the lane works."""

    def __init__(self, lanes: BulkLanes, quic: PeerLink, address: tuple[str, int]) -> None:
        self._lanes = lanes
        self.quic = quic
        self.address = address
        self.peer_id = quic.peer_id
        self.initiated_locally = quic.initiated_locally
        self.established_at = quic.established_at
        self._closed = quic._closed

    async def open_raw_stream(self) -> MeshStream:
        source = self.peer_id
        pool = self._lanes.pool
        if source not in self._lanes._lane_failed:
            connection = pool.take(source)
            if connection is not None:
                # Should the source have closed it meanwhile, the request goes out again on a new one.
                return connection.stream(pool.put, redial=self._dial)
            try:
                connection = await self._dial()
            except LANE_DIAL_FAILURES as exc:
                self._lanes.lane_failed(source, self.address, f"{type(exc).__name__}: {exc}")
            else:
                self._lanes.lane_used(source, self.address)
                return connection.stream(pool.put)
        return await self.quic.open_raw_stream()

    async def _dial(self) -> LaneConnection:
        host, port = self.address
        return await dial_lane(
            host, port, self._lanes.contexts, self.peer_id, timeout=self._lanes.connect_timeout
        )

    def close(self, reason: str = "") -> None:
        # The QUIC link is the node's; lane connections close with their streams.
        pass

    @property
    def description(self) -> str:
        return f"tls {self.address[0]}:{self.address[1]} (else {self.quic.description})"


__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "BulkLanes", "lane_address"]
