"""The link the node keeps to each peer, and a new one when a peer has none.

Which link is kept (a simultaneous dial's tie-break included) is
:class:`~meshnode.mesh.peer_links.PeerLinks`'s; how a peer is dialed (its announced
addresses, then its relays, a punched or LAN path beside them) is
:class:`~meshnode.mesh.peer_dialer.PeerDialer`'s. :class:`PeerConnections` holds the two
together: the dialer exists once the node has its socket and its relays (:meth:`start`).
Whether gossip ran on a link is not its business (see :mod:`meshnode.node.gossip`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from meshnode.membership.credentials import Endpoint
from meshnode.mesh.peer_dialer import PeerDialer
from meshnode.mesh.peer_links import PeerLinks
from meshnode.relaylink.manager import RelayLinks
from meshnode.transport.base import PeerLink
from meshnode.transport.quic import QuicEndpoint
from meshnode.traversal.direct_paths import DirectPaths
from meshnode.wire.pb import mesh


class PeerConnections:
    def __init__(
        self,
        node_id: bytes,
        *,
        announcement_of: Callable[[bytes], mesh.PeerAnnouncement | None],
        known_peers: list[Endpoint],
        race_window: float,
        connect_timeout: float,
        relay_only: bool,
    ) -> None:
        """``announcement_of``: what the peer table says of a peer (its addresses and relays);
        ``known_peers``: the node's peers to dial by address besides the table's."""
        self.links = PeerLinks(node_id, race_window=race_window)
        self._announcement_of = announcement_of
        self._known_peers = known_peers
        self._connect_timeout = connect_timeout
        self._relay_only = relay_only
        self._dialer: PeerDialer | None = None

    def start(self, endpoint: QuicEndpoint, relay_links: RelayLinks, shortcuts: DirectPaths) -> None:
        """Dial from ``endpoint`` (the node's socket), through ``relay_links``, and the direct
        paths to peers behind NAT that ``shortcuts`` knows."""
        self._dialer = PeerDialer(
            self.links,
            endpoint,
            relay_links,
            announcement_of=self._announcement_of,
            known_peers=lambda: self._known_peers,
            connect_timeout=self._connect_timeout,
            relay_only=self._relay_only,
            shortcuts=shortcuts,
        )

    async def connect(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink:
        """The link kept for ``peer_id``, dialed when there is none (one dial shared by all who
        wait for it); a new link does not go through ``avoid_relays``."""
        dialer = self._started_dialer()
        return await self.links.connect(peer_id, lambda peer: dialer.dial_peer(peer, avoid_relays))

    async def dial_endpoint(self, endpoint: Endpoint, via: Iterable[bytes] = ()) -> PeerLink:
        """A bootstrap or known peer by its address, else through our relays (``via`` first)."""
        return await self._started_dialer().dial_endpoint(endpoint, via=via)

    def _started_dialer(self) -> PeerDialer:
        assert self._dialer is not None, "the node dials only once started"
        return self._dialer


__all__ = ["PeerConnections"]
