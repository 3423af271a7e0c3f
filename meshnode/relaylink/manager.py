"""The node's relay side: registrations with its relays, and relayed links to peers.

:class:`RelayLinks` keeps one :class:`~meshnode.relaylink.client.RelayClient`
per relay the node was told about (invite, stored membership, ``--relay``,
peers' announcements) and turns relayed payloads into
:class:`~meshnode.relaylink.link.RelayedPeerLink` objects handed to the node's
:class:`~meshnode.transport.base.LinkHandler`, exactly like QUIC links.

A link is one sealed session with one peer through one relay. It ends when the
relay connection drops, when the relay reports the peer gone, when the peer
re-keys (a restart), or when the relay refuses one of its frames (a relayed
byte stream cannot have holes); the node then opens a new one on demand, and
the protocols above retry with their own idempotency rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.credentials import Endpoint
from meshnode.relaylink.client import RelayCallbacks, RelayCheck, RelayClient, RelayClientConfig
from meshnode.relaylink.link import RelayedPeerLink
from meshnode.relaylink.mux import MuxConfig
from meshnode.relaylink.seal import (
    CONTROL_CHANNEL,
    Dropped,
    Opened,
    PeerSealer,
    SendControl,
    SessionEstablished,
    SessionLost,
)
from meshnode.relaylink.send_turns import Sealer
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import relay
from meshnode.transport.base import LinkHandler, PeerLink, StreamError
from meshnode.transport.quic import QuicEndpoint
from meshnode.transport.udp_address import local_host_to_reach

log = logging.getLogger(__name__)

_Key = tuple[bytes, bytes]  # (relay id, peer id)


class RelayDialError(ConnectionError):
    """No relayed link to the peer could be set up; the message says why."""


@dataclass(frozen=True)
class RelayLinkConfig:
    handshake_timeout: float = 5.0
    # How long open_link waits for a registration when none is up yet.
    registration_wait: float = 5.0
    max_peers: int = 1024
    # Relays learned from peers' announcements registered with at once, besides our own.
    max_peer_relays: int = 8
    mux: MuxConfig = field(default_factory=MuxConfig)
    client: RelayClientConfig = field(default_factory=RelayClientConfig)


@dataclass
class RelayLinkStats:
    frames_dropped: int = 0  # relayed payloads that failed to open (tampered, replayed, forged, stale)
    handshakes: int = 0
    links_opened: int = 0
    refused_frames: int = 0
    # Sealed payload bytes through relays, both directions (handshakes included).
    bytes_sent: int = 0
    bytes_received: int = 0
    # The same, both directions together, by peer (the last MAX_COUNTED_PEERS peers counted).
    peer_bytes: dict[bytes, int] = field(default_factory=dict)

    def count(self, peer_id: bytes, nbytes: int, *, sent: bool) -> None:
        if sent:
            self.bytes_sent += nbytes
        else:
            self.bytes_received += nbytes
        self.peer_bytes[peer_id] = self.peer_bytes.pop(peer_id, 0) + nbytes
        if len(self.peer_bytes) > MAX_COUNTED_PEERS:
            del self.peer_bytes[next(iter(self.peer_bytes))]


# Peers whose relayed bytes are counted one by one (RelayLinkStats.peer_bytes).
MAX_COUNTED_PEERS = 1024


class RelayLinks:
    def __init__(
        self,
        identity: NodeIdentity,
        handler: LinkHandler,
        *,
        mesh_id: str,
        proof_for: Callable[[bytes], membership.MembershipProof | None],
        settings: RelayLinkConfig | None = None,
        local_host: str = "0.0.0.0",
        revocations: Callable[[], list[membership.Revocation]] = list,
        on_revocation: Callable[[membership.Revocation], None] | None = None,
        node_endpoint: QuicEndpoint | None = None,
        on_observed: Callable[[], None] | None = None,
    ) -> None:
        self.identity = identity
        self.handler = handler
        self.mesh_id = mesh_id
        self.settings = settings or RelayLinkConfig()
        self.stats = RelayLinkStats()
        self._proof_for = proof_for
        self._revocations = revocations
        self._on_revocation = on_revocation
        self._local_host = local_host
        # Registrations leave from the node's own socket where it can reach the relay.
        self._node_endpoint = node_endpoint
        # Told when the address a relay observes this node at changes (observed_addresses()).
        self._on_observed = on_observed
        self._clients: dict[bytes, RelayClient] = {}
        # Our own relays (never evicted); the other clients serve relays peers announce.
        self._own: set[bytes] = set()
        self._sealers: dict[_Key, PeerSealer] = {}
        self._links: dict[_Key, RelayedPeerLink] = {}
        self._pending: dict[_Key, asyncio.Future[RelayedPeerLink]] = {}
        self._any_registered = asyncio.Event()
        # Relays some peer stopped answering through (see open_link's ``avoid``).
        self._doubted: set[bytes] = set()
        self._closed = False
        # What each of this manager's relay clients reports into.
        self.client_callbacks = RelayCallbacks(
            deliver=self._on_deliver,
            peer_gone=self._on_peer_gone,
            send_refused=self._on_send_refused,
            up=self._on_up,
            down=self._on_down,
            silent=self._on_silent,
            observed=self._on_observed_address,
        )

    # -- relays ------------------------------------------------------------------------

    async def add_relays(self, endpoints: Iterable[Endpoint]) -> None:
        """Start registering with these relays of ours (invite, membership, ``--relay``), for good."""
        for endpoint in endpoints:
            self._own.add(endpoint.id)
            await self._start_client(endpoint)

    async def add_peer_relays(self, endpoints: Iterable[Endpoint]) -> None:
        """Start registering with relays a peer announces, to reach it through one of them.

        At most ``max_peer_relays`` besides ours at once: a relay holding no link makes room
        for a new one, so a member announcing ever new relays cannot make this node hold a
        socket and a registration loop for each.
        """
        for endpoint in endpoints:
            known = self._clients.get(endpoint.id)
            if known is not None:
                known.consider_address(endpoint.address)
                continue
            if self._closed:
                continue
            peer_relays = [rid for rid in self._clients if rid not in self._own]
            if len(peer_relays) >= self.settings.max_peer_relays and not await self._evict_idle_peer_relay():
                log.debug("not registering with relay %s: %d peer relays in use", endpoint, len(peer_relays))
                continue
            await self._start_client(endpoint)

    async def _evict_idle_peer_relay(self) -> bool:
        """Stop using a peer's relay that holds no link: one never registered first, else the oldest."""
        busy = {relay_id for relay_id, _peer in (*self._links, *self._pending)}
        idle = [c for rid, c in self._clients.items() if rid not in self._own and rid not in busy]
        if not idle:
            return False
        client = min(idle, key=lambda c: c.registered)  # stable: the oldest among equals
        del self._clients[client.relay_id]
        for key in [k for k in self._sealers if k[0] == client.relay_id]:
            self._drop_sealer(key)
        self._doubted.discard(client.relay_id)
        if not any(c.registered for c in self._clients.values()):
            self._any_registered.clear()  # a closed client reports no "down"
        log.debug("stopped using relay %s (idle; making room for another peer's relay)", client.endpoint_info)
        await client.close()
        return True

    async def _start_client(self, endpoint: Endpoint) -> None:
        if self._closed or endpoint.id in self._clients:
            return
        client = RelayClient(
            self.identity,
            endpoint,
            mesh_id=self.mesh_id,
            proof_for=self._proof_for,
            callbacks=self.client_callbacks,
            settings=self.settings.client,
        )
        client.on_revocation = self._on_revocation
        self._clients[endpoint.id] = client
        await client.start(local_host_to_reach(endpoint.address, self._local_host), self._node_endpoint)

    @property
    def relays(self) -> list[Endpoint]:
        return [client.endpoint_info for client in self._clients.values()]

    def observed_addresses(self) -> dict[bytes, str]:
        """Where each relay registered from the node's own socket sees it now, by relay id: behind
        NAT, the router's public address and the port it mapped that socket to."""
        return {
            relay_id: client.observed_address
            for relay_id, client in self._clients.items()
            if client.shares_node_socket and client.observed_address
        }

    def registered_relays(self) -> list[Endpoint]:
        return [client.endpoint_info for client in self._clients.values() if client.registered]

    def client(self, relay_id: bytes) -> RelayClient | None:
        return self._clients.get(relay_id)

    async def confirm_relay(self, relay_id: bytes, timeout: float) -> RelayCheck:
        """Whether ``relay_id`` answers us, on our connection or on a new registration made
        within ``timeout`` (RelayClient.confirm_alive); AWAY for a relay we do not use."""
        client = self._clients.get(relay_id)
        return RelayCheck.AWAY if client is None else await client.confirm_alive(timeout)

    async def wait_registered(self, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            await self._any_registered.wait()

    async def close(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            link.close("node shutting down")
        await asyncio.gather(*(client.close() for client in self._clients.values()), return_exceptions=True)
        self._clients.clear()

    def sealed_peers(self) -> set[bytes]:
        """The peers this node holds sealed-session state for (through any relay)."""
        return {peer for _relay, peer in self._sealers}

    @property
    def frames_dropped(self) -> int:
        """Relayed payloads dropped because they failed to open, ever (tampering shows here)."""
        return self.stats.frames_dropped

    # -- links ---------------------------------------------------------------------------

    async def open_link(
        self,
        peer_id: bytes,
        *,
        via: Iterable[bytes] = (),
        avoid: Iterable[bytes] = (),
        timeout: float | None = None,
    ) -> PeerLink:
        """A relayed link to ``peer_id`` through one of ``via`` (its announced relays), or any of ours.

        ``avoid`` names relays the peer stopped answering through: a relay that died
        without closing looks registered until its connection times out (15 s), and
        another relay the peer uses reaches it sooner. Until an avoided relay delivers
        again or reconnects, it is also the last choice for every other peer.
        """
        avoided = set(avoid)
        self._doubted |= avoided
        client = await self._pick_client(set(via), avoided)
        key = (client.relay_id, peer_id)
        link = self._links.get(key)
        if link is not None and not link.is_closed:
            return link
        future = self._pending.get(key)
        if future is None:
            sealer = self._sealer(key)
            future = asyncio.get_running_loop().create_future()
            self._pending[key] = future
            try:
                hello = sealer.start()
                client.send(peer_id, CONTROL_CHANNEL, hello)
                self.stats.count(peer_id, len(hello), sent=True)
            except StreamError as exc:
                self._fail_pending(key, RelayDialError(str(exc)))
        try:
            async with asyncio.timeout(timeout or self.settings.handshake_timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            self._fail_pending(key, RelayDialError("no handshake answer"))
            raise RelayDialError(
                f"{short_id(peer_id)} did not answer a sealed handshake through relay {client.endpoint_info}"
            ) from None

    async def _pick_client(self, via: set[bytes], avoid: set[bytes]) -> RelayClient:
        def usable(avoiding: set[bytes]) -> list[RelayClient]:
            return [c for c in self._clients.values() if c.relay_id not in avoiding]

        def candidates(avoiding: set[bytes]) -> list[RelayClient]:
            ours = [c for c in usable(avoiding) if c.registered]
            shared = [c for c in ours if c.relay_id in via]
            found = shared or ([] if via & {c.relay_id for c in usable(avoiding)} else ours)
            return sorted(found, key=lambda c: c.relay_id in self._doubted)  # stable: doubted ones last

        found = candidates(avoid)
        if not found and usable(avoid):
            # Registrations may still be coming up (node start, relay restart).
            deadline = asyncio.get_running_loop().time() + self.settings.registration_wait
            while not found and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                found = candidates(avoid)
        if not found and avoid:
            # No other relay reaches the peer: the one it went silent through is still worth a
            # try (a lossy or congested path is slow, not dead; a dead relay fails this dial).
            found = candidates(set())
        if not found:
            names = ", ".join(str(c.endpoint_info) for c in usable(avoid)) or (
                "none besides the one it stopped answering through" if avoid else "none configured"
            )
            raise RelayDialError(f"not registered with a relay the peer uses (relays: {names})")
        return found[0]

    def _sealer(self, key: _Key) -> PeerSealer:
        sealer = self._sealers.get(key)
        if sealer is None:
            if len(self._sealers) >= self.settings.max_peers and not self._evict_idle_sealer():
                raise RelayDialError("too many relayed peers")
            sealer = self._sealers[key] = PeerSealer(self.identity, key[1])
        return sealer

    def _evict_idle_sealer(self) -> bool:
        """Forget the oldest peer with neither a link nor a handshake in progress."""
        for key in self._sealers:  # insertion order: oldest first
            if key not in self._links and key not in self._pending:
                self._drop_sealer(key)
                return True
        return False

    def _fail_pending(self, key: _Key, error: Exception) -> None:
        # A failed dial leaves no initiation behind: the lower id's initiation wins a
        # simultaneous handshake, so a stale one would make us ignore every INIT the
        # peer sends later (seen after a relay restart: our INIT was refused because the
        # peer had not re-registered yet, and the peer's own dials then went unanswered).
        sealer = self._sealers.get(key)
        if sealer is not None:
            sealer.abandon()
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_exception(error)
            future.exception()

    def _end_link(self, key: _Key, reason: str) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            link.terminate(reason)

    # -- relay client callbacks ---------------------------------------------------------------

    def _on_deliver(self, client: RelayClient, source: bytes, channel: int, payload: bytes) -> None:
        key = (client.relay_id, source)
        if source == self.identity.node_id:
            return
        self._doubted.discard(client.relay_id)  # it delivers: alive
        self.stats.count(source, len(payload), sent=False)
        try:
            sealer = self._sealer(key)
        except RelayDialError:
            self.stats.frames_dropped += 1
            return
        sealer.receive_payload(channel, payload)
        for event in sealer.take_events():
            if isinstance(event, Opened):
                link = self._links.get(key)
                if link is not None and link.session is event.session:
                    link.record_received(event.channel, event.plaintext)
            elif isinstance(event, SendControl):
                with contextlib.suppress(StreamError):
                    client.send(source, CONTROL_CHANNEL, event.payload)
                    self.stats.count(source, len(event.payload), sent=True)
            elif isinstance(event, SessionEstablished):
                self._established(client, key, event)
            elif isinstance(event, Dropped):
                if event.counted:
                    self.stats.frames_dropped += 1
                    log.debug("dropped relayed frame from %s: %s", short_id(source), event.reason)
            elif isinstance(event, SessionLost):
                self._end_link(key, "peer lost the sealed session (it restarted)")

    def _established(self, client: RelayClient, key: _Key, event: SessionEstablished) -> None:
        self._end_link(key, "peer re-keyed the relayed session")
        self.stats.handshakes += 1
        peer_id = key[1]

        def send(channel: int, record: bytes, seal: Sealer) -> None:
            def seal_and_count(channel: int, record: bytes) -> bytes | None:
                # Counted as it leaves: a record of a link that ended while it waited is not sent.
                payload = seal(channel, record)
                if payload is not None:
                    self.stats.count(peer_id, len(payload), sent=True)
                return payload

            client.send(peer_id, channel, record, seal_and_count)

        link = RelayedPeerLink(
            session=event.session,
            send=send,
            handler=self.handler,
            relay_id=client.relay_id,
            relay_description=str(client.endpoint_info),
            mux_config=self.settings.mux,
            on_closed=functools.partial(self._link_closed, key),
        )
        self._links[key] = link
        self.stats.links_opened += 1
        log.info(
            "relayed link to %s via %s (%s)",
            short_id(peer_id),
            client.endpoint_info,
            "dialed" if link.initiated_locally else "accepted",
        )
        self.handler.link_established(link)
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(link)

    def _link_closed(self, key: _Key, link: RelayedPeerLink) -> None:
        if self._links.get(key) is link:
            del self._links[key]
        sealer = self._sealers.get(key)
        if sealer is not None and sealer.current is link.session:
            sealer.forget_session()

    def _on_peer_gone(self, client: RelayClient, peer_id: bytes, reason: str) -> None:
        key = (client.relay_id, peer_id)
        self._end_link(key, f"peer left relay {client.endpoint_info}: {reason}")
        self._fail_pending(key, RelayDialError(f"peer left the relay: {reason}"))
        self._drop_sealer(key)

    def _on_send_refused(self, client: RelayClient, refused: relay.RelaySendRefused) -> None:
        self.stats.refused_frames += 1
        key = (client.relay_id, bytes(refused.destination_id))
        why = str(p.RelayRefused.from_pb(refused.refusal))
        self._fail_pending(key, RelayDialError(f"relay refused the handshake: {why}"))
        # A refused frame is a hole in a relayed byte stream: the link cannot continue.
        self._end_link(key, f"relay refused a frame: {why}")

    def _on_up(self, client: RelayClient) -> None:
        self._any_registered.set()
        self._doubted.discard(client.relay_id)
        # Each registration hands over what we know: a relay that restarted or never heard learns it.
        client.send_revocations(self._revocations())

    def publish_revocations(self, revocations: list[membership.Revocation]) -> None:
        """Tell every relay we are registered with (the others hear on registration)."""
        for client in self._clients.values():
            client.send_revocations(revocations)

    def _on_down(self, client: RelayClient, reason: str) -> None:
        for key in [k for k in self._links if k[0] == client.relay_id]:
            self._end_link(key, f"relay connection lost: {reason}")
        for key in [k for k in self._pending if k[0] == client.relay_id]:
            self._fail_pending(key, RelayDialError(f"relay connection lost: {reason}"))
        for key in [k for k in self._sealers if k[0] == client.relay_id]:
            self._drop_sealer(key)
        if not any(c.registered for c in self._clients.values()):
            self._any_registered.clear()

    def _on_observed_address(self, client: RelayClient, address: str) -> None:
        if self._on_observed is not None and client.shares_node_socket:
            self._on_observed()

    def _on_silent(self, client: RelayClient, reason: str) -> None:
        # New links go elsewhere while it may be dead, and dials waiting on it fail now rather
        # than at their handshake timeout: a probe's second chance must not join one of them.
        # Links through it stay until the registration moves to a new connection or this one is
        # given up (then they end, as frames in flight on it may be lost).
        self._doubted.add(client.relay_id)
        for key in [k for k in self._pending if k[0] == client.relay_id]:
            self._fail_pending(key, RelayDialError(f"relay {client.endpoint_info} went silent: {reason}"))

    def _drop_sealer(self, key: _Key) -> None:
        self._sealers.pop(key, None)


__all__ = ["RelayDialError", "RelayLinkConfig", "RelayLinkStats", "RelayLinks"]
