"""The node runtime: identity + QUIC transport + dispatcher + membership, on asyncio.

Protocol decisions live in :mod:`meshnode.mesh` (pure); this module only moves
frames between streams and :class:`~meshnode.mesh.state.MeshState`, drives its
heartbeat timer (and the probes it asks for) and keeps the membership state on disk.
It gives the state two clocks, as :mod:`meshnode.sansio` says: ``time.monotonic_ns()``
for liveness, and ``time.time()`` beside it where a credential or a record's
incarnation is checked. The link kept per peer and how a peer is dialed are
:mod:`meshnode.mesh.peer_links` and :mod:`meshnode.mesh.peer_dialer`; the status
report and its socket are :mod:`meshnode.node.status_report` and
:mod:`meshnode.node.status_server`; revocations, renewals and this node's own
removal are :mod:`meshnode.node.membership_keeper`'s (``node.removal`` is set,
with ``node.removal_reason``, once this node is out of the mesh), which tells the node
which revocations to spread; whether a peer still answers is
:mod:`meshnode.node.reachability`'s.

What later layers use:

* ``node.register_handler(StreamType.X, handler)`` — serve more stream types
  (admitted peers only); handlers get a :class:`~meshnode.transport.framed.FramedStream`.
* ``await node.get_link(peer_id)`` — a link to a peer that has admitted us
  (dials the announced addresses first; falls back to a relayed link through the
  relays the peer announces when that fails or the peer is not directly
  reachable, see :mod:`meshnode.relaylink`).
* ``node.set_serving(...)`` / ``set_capacity`` / ``set_load`` — what this node
  announces; ``node.peers()`` — the peer table.
* ``node.set_api_url(url)``, ``node.add_status_section(name, provider)`` /
  ``remove_status_section(name)`` — what ``meshnode status`` shows besides the mesh.
* ``await node.shutdown()`` — PeerLeaving to every peer, then close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

from meshnode import __version__
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.credentials import Endpoint, Invite
from meshnode.membership.relay_list import merge_relays
from meshnode.membership.revocation import Revoked
from meshnode.membership.store import DataDir, MembershipState
from meshnode.mesh.credential_gate import REVOCATION_CODES
from meshnode.mesh.dispatcher import Dispatcher, StreamHandler
from meshnode.mesh.message_reader import read_message
from meshnode.mesh.peer_dialer import PeerDialer, PeerUnreachable
from meshnode.mesh.peer_links import PeerLinks
from meshnode.mesh.peer_table import MergeReport, PeerEntry
from meshnode.mesh.ratelog import RateLimitedLog
from meshnode.mesh.rules import (
    PeerDownAction,
    PeerLeavingAction,
    resolve_peer_down,
    resolve_peer_leaving,
)
from meshnode.mesh.state import HeartbeatDue, MeshState, PeerStale
from meshnode.mesh.validation import (
    decode,
    validate_peer_down,
    validate_peer_leaving,
    validate_probe,
    validate_route_request,
)
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.config import DEFAULT_LISTEN, DEFAULT_PORT, JoinError, NodeConfig
from meshnode.node.membership_keeper import MembershipKeeper, load_revocations
from meshnode.node.peer_failures import PEER_FAILURES
from meshnode.node.reachability import Reachability
from meshnode.node.status_report import StatusReport, node_status
from meshnode.node.status_server import StatusServer
from meshnode.relaylink.manager import RelayLinks
from meshnode.sansio import SECOND_NS
from meshnode.timer_edge import run_timer
from meshnode.transport.addresses import format_host_port, parse_host_port
from meshnode.transport.base import LinkClosed, MeshStream, PeerLink
from meshnode.transport.framed import FramedStream
from meshnode.transport.local_addresses import default_advertised
from meshnode.transport.quic import QuicEndpoint
from meshnode.transport.request_reply import request_reply
from meshnode.traversal.direct_paths import DirectPaths
from meshnode.wire.framing import NODE_PROTOCOL_GENERATION, StreamType
from meshnode.wire.mesh_refusal import MeshRefusal, RemoteRefusal, in_words
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

_LINK_ATTEMPTS = 3
# How long the last frame to a removed peer may take before its link is closed anyway.
_FAREWELL_TIMEOUT_S = 2.0


def _exchanged_ok(done: asyncio.Future[None] | None) -> bool:
    """Whether a gossip exchange on a link completed (a cancelled one, its caller timed out,
    proves nothing)."""
    return done is not None and done.done() and not done.cancelled() and done.exception() is None


def _to_ns(seconds: float) -> int:
    return round(seconds * SECOND_NS)


class Node:
    def __init__(
        self,
        identity: NodeIdentity,
        data_dir: DataDir,
        config: NodeConfig,
        *,
        membership: MembershipState | None = None,
        invite: Invite | None = None,
    ) -> None:
        self.identity = identity
        self.data_dir = data_dir
        self.config = config
        mesh_id = membership.mesh_id if membership is not None else invite.mesh_id if invite else ""
        local = mesh.PeerAnnouncement(
            role=config.role,  # type: ignore[arg-type]
            http_port=config.http_port,
            version=__version__,
            hostname=socket.gethostname()[:255],
            directly_reachable=config.directly_reachable,
            incarnation=time.time_ns(),
        )
        self.state = MeshState(
            identity=identity,
            mesh_id=mesh_id,
            local=local,
            membership=membership,
            invite=invite,
            heartbeat_interval_ns=_to_ns(config.heartbeat_interval),
            peer_timeout_ns=_to_ns(config.effective_peer_timeout),
            tombstone_ttl_ns=_to_ns(config.tombstone_ttl),
            revocations=load_revocations(data_dir, mesh_id),
            certificate_ttl_s=config.certificate_ttl,
        )
        if membership is not None:
            local.relays.extend(
                mesh.RelayEndpoint(relay_id=r.id, address=r.address) for r in membership.relays
            )
            known_peers = list(membership.known_peers)
        else:
            assert invite is not None
            local.relays.extend(mesh.RelayEndpoint(relay_id=r.id, address=r.address) for r in invite.relays)
            known_peers = list(invite.bootstrap)
        self.dispatcher = Dispatcher(
            is_admitted=self.state.is_admitted,
            stream_type_timeout=config.stream_type_timeout,
            check_peer=self.state.revocations.check_node,
        )
        self.dispatcher.register(StreamType.GOSSIP, self._serve_gossip, before_admission=True)
        self.dispatcher.register(StreamType.ROUTE_REQUEST, self._serve_route_request, before_admission=True)
        self.dispatcher.register(StreamType.PEER_DOWN, self._serve_peer_down)
        self.dispatcher.register(StreamType.PEER_LEAVING, self._serve_peer_leaving)
        self.dispatcher.register(StreamType.PROBE, self._serve_probe)
        self.endpoint: QuicEndpoint | None = None
        self.relay_links: RelayLinks | None = None
        self.started_at_ns = time.monotonic_ns()
        self.gossip_refusals: dict[str, int] = {}
        self._refusal_log = RateLimitedLog(log)
        # Peers to dial by address besides the peer table's: the stored known peers, or the invite's.
        self._known_peers = known_peers
        self._links = PeerLinks(identity.node_id, race_window=config.link_race_window)
        # Direct paths to peers behind NAT: punching, the LAN shortcut, their watch.
        self.traversal = DirectPaths(
            self.state, self._links, lambda: self.relay_links, config.traversal, relay_only=config.relay_only
        )
        self.dispatcher.register(StreamType.HOLE_PUNCH, self.traversal.serve_punch)
        self._dialer: PeerDialer | None = None
        self._exchanged: dict[PeerLink, asyncio.Future[None]] = {}
        self._probing: set[bytes] = set()
        self._heartbeating: set[bytes] = set()
        self._beats = 0
        self._background = BackgroundTasks()
        self._status_server: StatusServer | None = None
        # Named sections `meshnode status` shows besides the mesh view (added by what runs on the node).
        self._status_sections: dict[str, Callable[[], dict[str, Any]]] = {}
        self._stopped = False
        # Where this node's OpenAI-compatible API listens (told by the head), for `meshnode generate`.
        self._api_url: str | None = None
        self.keeper = MembershipKeeper(self.state, data_dir, self._known_peers)
        # Set once this node is out of the mesh (removed, or its certificate expired); see keeper.
        self.removal = self.keeper.removal
        self._reachability = Reachability(self, self.traversal)

    # -- identity and announcement -------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    @property
    def mesh_id(self) -> str:
        return self.state.mesh_id

    @property
    def removal_reason(self) -> str:
        return self.keeper.removal_reason

    @property
    def addresses(self) -> list[str]:
        return list(self.state.local.addresses)

    def set_serving(self, serving: mesh.ServedShard | None) -> None:
        if serving is None:
            self.state.local.ClearField("serving")
        else:
            self.state.local.serving.CopyFrom(serving)

    def set_capacity(self, capacity: mesh.Capacity) -> None:
        self.state.local.capacity.CopyFrom(capacity)

    def set_load(self, load: mesh.Load) -> None:
        self.state.local.load.CopyFrom(load)

    def register_handler(
        self, stream_type: StreamType, handler: StreamHandler, *, before_admission: bool = False
    ) -> None:
        self.dispatcher.register(stream_type, handler, before_admission=before_admission)

    def peers(self) -> list[PeerEntry]:
        return self.state.table.entries()

    def add_known_peer(self, endpoint: Endpoint) -> None:
        """Dial ``endpoint.id`` at ``endpoint.address`` while the peer table does not list it
        (like the stored known peers, among which it is saved)."""
        self._known_peers.append(endpoint)

    @property
    def background_tasks(self) -> frozenset[asyncio.Task[Any]]:
        """What runs on its own until shutdown: the heartbeat timer and the heartbeats, probes and
        reconnects it started."""
        return self._background.running

    # -- what `meshnode status` shows besides the mesh ------------------------------------

    @property
    def api_url(self) -> str | None:
        """Where this node's OpenAI-compatible API listens, once a head serves one here."""
        return self._api_url

    def set_api_url(self, url: str) -> None:
        self._api_url = url

    @property
    def status_sections(self) -> Mapping[str, Callable[[], dict[str, Any]]]:
        return MappingProxyType(self._status_sections)

    def add_status_section(self, name: str, provider: Callable[[], dict[str, Any]]) -> None:
        """Show ``provider()`` as the status report's section ``name`` (replacing one so named)."""
        self._status_sections[name] = provider

    def remove_status_section(self, name: str) -> None:
        self._status_sections.pop(name, None)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        host, port = parse_host_port(self.config.listen, allow_zero_port=True)
        self.endpoint = await QuicEndpoint.listen(self.identity, self, host, port, self.config.quic)
        bound_host, bound_port = self.endpoint.local_address
        advertise = self.config.advertise or default_advertised(bound_host, bound_port)
        self.state.local.ClearField("addresses")
        self.state.local.addresses.extend(advertise)
        await self._start_relays()
        self._dialer = PeerDialer(
            self._links,
            self.endpoint,
            self.relay_links,
            announcement_of=self.state.table.announcement_of,
            known_peers=lambda: self._known_peers,
            connect_timeout=self.config.connect_timeout,
            relay_only=self.config.relay_only,
            shortcuts=self.traversal,
        )
        self.traversal.start(self.endpoint, self)
        self._status_server = StatusServer(self.data_dir.control_socket, self.status, control=self._control)
        await self._status_server.start()
        self.state.start_heartbeat(time.monotonic_ns())
        # A background task, so that cancelling them (shutdown, a test's crash) stops the heartbeat.
        self._background.spawn(run_timer(self.state.get_timer, self._mesh_timer))
        self._after_gossip()  # a node whose data directory holds its own removal stops here
        log.info(
            "node %s listening on %s (QUIC %s), advertising %s; mesh %s",
            self.identity.short_id,
            format_host_port(bound_host, bound_port),
            "mesh-llm/1",
            ", ".join(advertise),
            self.mesh_id,
        )

    async def _start_relays(self) -> None:
        """Register with our relays: the invite's / membership's, merged with the command line's."""
        local = self.state.local
        merged = merge_relays(
            [Endpoint(id=bytes(r.relay_id), address=r.address) for r in local.relays],
            self.config.relays,
            forget=self.config.forget_relays,
        )
        del local.relays[:]
        local.relays.extend(mesh.RelayEndpoint(relay_id=r.id, address=r.address) for r in merged.relays)
        for change in merged.changes:
            log.info("%s", change)
        if self.config.relay_only and not merged.relays:
            log.warning(
                "--relay-only with no relay: this node dials no peer, and only peers that dial it "
                "reach it; name a relay with --relay RELAY_ID@HOST:PORT"
            )
        membership = self.state.membership
        if membership is not None and merged.changes:
            membership.relays = merged.relays
            self.keeper.save_membership()
        # Always present: a node with no relays of its own still reaches NATed peers through the
        # relays they announce (registered on first use, see PeerDialer.dial_peer).
        self.relay_links = RelayLinks(
            self.identity,
            self,
            mesh_id=self.mesh_id,
            proof_for=self.state.our_proof,
            revocations=self.state.revocations.signed,
            on_revocation=self._revocation_from_relay,
            node_endpoint=self.endpoint,
            on_observed=self.traversal.observed_changed,
        )
        await self.relay_links.add_relays(
            Endpoint(id=bytes(r.relay_id), address=r.address) for r in local.relays
        )

    async def join(self) -> None:
        """Invite holder: dial bootstrap peers until one admits us and grants membership."""
        assert self.state.invite is not None
        reasons: list[str] = []
        refused = False
        invite_relays = [r.id for r in self.state.invite.relays]
        for endpoint in self.state.invite.bootstrap:
            try:
                link = await self._started_dialer().dial_endpoint(endpoint, via=invite_relays)
                await self._exchange(link)
            except RemoteRefusal as refusal:
                log.warning(
                    "bootstrap peer %s refused us: %s", endpoint, in_words(refusal.code, refusal.detail)
                )
                reasons.append(in_words(refusal.code, refusal.detail))
                refused = True
                if self.removal.is_set():
                    break  # a verified revocation names us: no other member will admit us
                continue
            except MeshRefusal as refusal:
                # An answer, though one we refuse (another mesh, a forged grant): no retry helps.
                log.warning("bootstrap peer %s answered what we refuse: %s", endpoint, refusal)
                reasons.append(f"{endpoint}: {refusal}")
                refused = True
                continue
            except PEER_FAILURES as exc:
                log.warning("bootstrap peer %s failed: %s", endpoint, exc or type(exc).__name__)
                reasons.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            if self.state.is_member:
                self.keeper.save_membership()
                log.info("joined mesh %s via %s", self.mesh_id, short_id(endpoint.id))
                return
        if refused or not reasons:
            raise JoinError("join refused: " + ("; ".join(reasons) or "no bootstrap peers"), refused=True)
        raise JoinError("no bootstrap peer reachable: " + "; ".join(reasons), refused=False)

    async def reconnect(self) -> int:
        """Member restart: gossip with the peers we knew until one answers; returns how many had.

        Gossip names the rest, and the dials to the others go on: one that stopped for good (the
        stored peers keep those) must not hold the node's start for its dial timeout."""
        dials = [
            self._background.spawn(self._bootstrap_one(e)) for e in self._known_peers if e.id != self.node_id
        ]
        for dial in asyncio.as_completed(dials):
            with contextlib.suppress(Exception):  # logged as the background task it is
                if await dial:
                    break
        reached = sum(1 for d in dials if d.done() and not d.cancelled() and not d.exception() and d.result())
        if dials:
            later = "" if all(d.done() for d in dials) else " so far (still dialing the others)"
            log.info(
                "rejoined mesh %s: %d of %d known peers answered%s", self.mesh_id, reached, len(dials), later
            )
        return reached

    async def shutdown(self) -> None:
        """Announce PeerLeaving to every linked peer, then close everything."""
        if self._stopped:
            return
        self._stopped = True
        await self._background.stop()
        links = self._links.live()
        if links:
            await asyncio.gather(*(self._send_leaving(link) for link in links), return_exceptions=True)
        if self.state.is_member:
            self.keeper.save_membership()
        await self.dispatcher.aclose()
        if self._status_server is not None:
            self._status_server.close()
        await self.traversal.close()
        if self.relay_links is not None:
            await self.relay_links.close()
        if self.endpoint is not None:
            self.endpoint.close()
            # The CONNECTION_CLOSE datagrams go out first; then the port is free for a restart.
            await self.endpoint.wait_closed()
        log.info("node %s stopped", self.identity.short_id)

    # -- links -----------------------------------------------------------------------

    async def get_link(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink:
        """A live link to ``peer_id`` on which a gossip exchange (mutual admission) completed.

        A new link does not go through ``avoid_relays`` (see :meth:`reachable`).
        """
        for attempt in range(_LINK_ATTEMPTS):
            link = await self._connect(peer_id, avoid_relays)
            try:
                await self._ensure_exchanged(link)
            except LinkClosed:
                # Lost a simultaneous-dial tie-break (or died): the survivor, or a new dial, is next.
                if attempt == _LINK_ATTEMPTS - 1:
                    raise
                continue
            return link
        raise AssertionError("unreachable")

    def _started_dialer(self) -> PeerDialer:
        assert self._dialer is not None, "the node dials only once started"
        return self._dialer

    async def _connect(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink:
        dialer = self._started_dialer()
        return await self._links.connect(peer_id, lambda peer: dialer.dial_peer(peer, avoid_relays))

    async def _ensure_exchanged(self, link: PeerLink) -> None:
        if not _exchanged_ok(self._exchanged.get(link)):
            await self._exchange(link)

    def link_established(self, link: PeerLink) -> None:
        self._links.add(link)

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.dispatcher.accept(stream)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        self.traversal.link_closed(link, was_kept=self._links.remove(link))
        self._exchanged.pop(link, None)

    def link_to(self, peer_id: bytes) -> PeerLink | None:
        """The live link kept for ``peer_id`` (whether or not gossip has run on it yet), or ``None``."""
        return self._links.get(peer_id)

    # -- gossip ----------------------------------------------------------------------

    async def _exchange(self, link: PeerLink) -> None:
        """Send our GossipFrame on a new stream and take the reply (opening side)."""
        done = asyncio.get_running_loop().create_future()
        if not _exchanged_ok(self._exchanged.get(link)):
            # Not a heartbeat's on a link already exchanged: get_link would wait for it.
            self._exchanged[link] = done
        try:
            frame = self.state.gossip_frame(link.peer_id).SerializeToString()
            data = await request_reply(link, StreamType.GOSSIP, frame, timeout=self.config.gossip_timeout)
            if data is None:
                raise MeshRefusal(mesh.MESH_ERROR_PROTOCOL, "gossip stream ended without a reply")
            was_member = self.state.is_member
            outcome = self.state.receive_gossip_reply(
                decode(mesh.GossipFrame, data),
                peer_id=link.peer_id,
                now_ns=time.monotonic_ns(),
                unix_now=time.time(),
            )
        except asyncio.CancelledError:
            done.cancel()
            raise
        except Exception as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: callers see `exc` re-raised below
            self._after_gossip()
            if isinstance(exc, RemoteRefusal):
                self.keeper.remote_refused(exc)
            raise
        done.set_result(None)
        self._after_gossip()
        if outcome.renewed:
            log.info("membership certificate renewed by %s", short_id(link.peer_id))
            self.keeper.save_membership()
        if outcome.joined and not was_member:
            log.info(
                "admitted to mesh %s by %s; stored membership certificate",
                self.mesh_id,
                short_id(link.peer_id),
            )
        if outcome.newly_admitted:
            log.info("admitted peer %s (member certificate)", short_id(link.peer_id))
        self._log_merge(outcome.merged, link.peer_id)

    async def _serve_gossip(self, stream: FramedStream) -> None:
        frame = await read_message(stream, mesh.GossipFrame, self.config.gossip_timeout)
        peer_id = stream.peer_id
        try:
            outcome = self.state.receive_gossip(
                frame, peer_id=peer_id, now_ns=time.monotonic_ns(), unix_now=time.time()
            )
        except MeshRefusal as refusal:
            self.gossip_refusals[refusal.code_name] = self.gossip_refusals.get(refusal.code_name, 0) + 1
            self._refusal_log.log(
                logging.INFO,
                "refused gossip from %s: %s",
                short_id(peer_id),
                in_words(refusal.code, refusal.detail),
            )
            self._after_gossip()
            await stream.send_frame(self.state.refusal_frame(refusal).SerializeToString())
            return
        self._after_gossip()
        if outcome.invite_id:
            self.keeper.invite_used(outcome.invite_id, peer_id)
        if outcome.newly_admitted:
            how = "invite" if outcome.via_invite else "member certificate"
            log.info("admitted peer %s (%s)", short_id(peer_id), how)
        self._log_merge(outcome.merged, peer_id)
        await stream.send_frame(outcome.reply.SerializeToString())
        link = self._links.get(peer_id)
        if link is not None and link not in self._exchanged:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self._exchanged[link] = done

    def _after_gossip(self) -> None:
        """Spread what the keeper took from the state (a gossip exchange's, a relay's or the control
        socket's revocations): to every relay and every peer at once, and one last frame to a
        removed peer, which carries the revocation that names it, before its link is closed."""
        learned = self.keeper.after_gossip()
        if not learned:
            return
        if self.relay_links is not None:
            self.relay_links.publish_revocations([revoked.signed for revoked in learned])
        for revoked in learned:
            if revoked.kind == "node" and revoked.target != self.node_id:
                link = self._links.get(revoked.target)
                if link is not None:
                    self._background.spawn(self._farewell(link, revoked))
        self._gossip_with_all()

    async def _farewell(self, link: PeerLink, revoked: Revoked) -> None:
        try:
            async with asyncio.timeout(_FAREWELL_TIMEOUT_S):
                await self._exchange(link)
        except Exception as exc:  # its refusal, or its silence, changes nothing now
            log.debug("last frame to removed %s: %s", short_id(revoked.target), exc or type(exc).__name__)
        link.close(f"removed: {revoked.describe()}")

    def _revocation_from_relay(self, revocation: membership.Revocation) -> None:
        self.keeper.relayed_revocation(revocation)
        self._after_gossip()

    def _control(self, request: str) -> dict[str, Any]:
        """The control socket's requests (the keeper's); a revocation it accepted spreads at once."""
        answer = self.keeper.control(request)
        self._after_gossip()
        return answer

    def _log_merge(self, report: MergeReport, source: bytes) -> None:
        for drop in report.dropped:  # counted in state.record_drops
            self._refusal_log.log(logging.WARNING, "dropped a %s sent by %s", drop, short_id(source))
        for peer_id in report.added:
            how = "" if peer_id == source else f" (via {short_id(source)})"
            log.info("peer %s joined our view%s", short_id(peer_id), how)
        if report.ignored_full:
            log.warning("peer table full: ignored %d announcements", len(report.ignored_full))

    async def _serve_route_request(self, stream: FramedStream) -> None:
        request = await read_message(stream, mesh.RouteTableRequest, self.config.gossip_timeout)
        validate_route_request(request, stream.peer_id)
        await stream.send_frame(self.state.route_table().SerializeToString())

    # -- liveness ----------------------------------------------------------------------

    def _mesh_timer(self, now_ns: int) -> None:
        self.state.handle_timer(now_ns)
        for event in self.state.take_events():
            if isinstance(event, HeartbeatDue):
                self._beats += 1
                self._heartbeat(self._beats)
            elif isinstance(event, PeerStale):
                self._suspect(event.peer_id, reporter=None)

    def _heartbeat(self, beats: int) -> None:
        """Gossip with every peer (with the known peers while there is none); save them every tenth beat."""
        self.keeper.on_heartbeat()
        self._gossip_with_all()
        if not len(self.state.table) and self.state.is_member:
            for endpoint in self._known_peers:
                if endpoint.id != self.node_id and endpoint.id not in self._heartbeating:
                    self._background.spawn(self._bootstrap_one(endpoint))
        if beats % 10 == 0 and self.state.is_member:
            self.keeper.save_membership()

    def _gossip_with_all(self) -> None:
        for peer_id in self.state.table.peer_ids():
            if peer_id not in self._heartbeating:
                self._background.spawn(self._heartbeat_peer(peer_id))

    async def _heartbeat_peer(self, peer_id: bytes) -> None:
        self._heartbeating.add(peer_id)
        try:
            async with asyncio.timeout(self.config.connect_timeout + self.config.gossip_timeout):
                link = await self._connect(peer_id)
                await self._exchange(link)
        except RemoteRefusal as refusal:
            log.info("peer %s refused our heartbeat: %s", short_id(peer_id), refusal.detail)
        except PEER_FAILURES as exc:
            log.debug("heartbeat to %s failed: %s", short_id(peer_id), exc or type(exc).__name__)
            self._suspect(peer_id, reporter=None)
        finally:
            self._heartbeating.discard(peer_id)

    async def _bootstrap_one(self, endpoint: Endpoint) -> bool:
        self._heartbeating.add(endpoint.id)
        try:
            link = await self._started_dialer().dial_endpoint(endpoint)
            await self._exchange(link)
            return True
        except PEER_FAILURES as exc:
            log.debug("known peer %s did not answer: %s", endpoint, exc or type(exc).__name__)
            return False
        finally:
            self._heartbeating.discard(endpoint.id)

    def _suspect(self, peer_id: bytes, *, reporter: bytes | None) -> None:
        if peer_id in self._probing or peer_id not in self.state.table:
            return
        self._probing.add(peer_id)
        self._background.spawn(self._confirm_down(peer_id, reporter))

    async def _confirm_down(self, peer_id: bytes, reporter: bytes | None) -> None:
        try:
            if await self.reachable(peer_id):
                return
            why = "unreachable, probe failed" + (f" (reported by {short_id(reporter)})" if reporter else "")
            if self._drop(peer_id, why, close_link=True) and reporter is None:
                await self._broadcast_peer_down(peer_id)
        finally:
            self._probing.discard(peer_id)

    async def reachable(self, peer_id: bytes, probe_timeout: float | None = None) -> bool:
        """Whether the peer answers a probe, or the second chances of
        :class:`meshnode.node.reachability.Reachability`. Each probe waits ``probe_timeout``
        at most (default: the node's ``probe_timeout``)."""
        timeout = self.config.probe_timeout if probe_timeout is None else probe_timeout
        return await self._reachability.reachable(peer_id, timeout)

    async def probe(
        self, peer_id: bytes, avoid_relays: Collection[bytes] = (), timeout: float | None = None
    ) -> bool:
        """True when the peer echoes a PROBE within ``timeout`` (default: ``probe_timeout``).

        A new link does not go through ``avoid_relays``.
        """
        wait = self.config.probe_timeout if timeout is None else timeout
        answered, _link = await self._reachability.probe_on_link(peer_id, avoid_relays, wait)
        return answered

    async def _serve_probe(self, stream: FramedStream) -> None:
        probe = await read_message(stream, mesh.Probe, self.config.probe_timeout)
        validate_probe(probe)
        await stream.send_frame(probe.SerializeToString())

    async def _broadcast_peer_down(self, peer_id: bytes) -> None:
        report = mesh.PeerDown(peer_id=peer_id, gen=NODE_PROTOCOL_GENERATION).SerializeToString()

        async def tell(link: PeerLink) -> None:
            await request_reply(link, StreamType.PEER_DOWN, report, timeout=self.config.gossip_timeout)

        links = [link for link in self._links.live() if link.peer_id != peer_id]
        await asyncio.gather(*(tell(link) for link in links), return_exceptions=True)

    async def _serve_peer_down(self, stream: FramedStream) -> None:
        report = await read_message(stream, mesh.PeerDown, self.config.gossip_timeout)
        validate_peer_down(report)
        reported = bytes(report.peer_id)
        action = resolve_peer_down(
            reported_id=reported,
            reporter_id=stream.peer_id,
            self_id=self.node_id,
            known=reported in self.state.table,
        )
        if action is PeerDownAction.REJECT_SELF_REPORT:
            raise MeshRefusal(mesh.MESH_ERROR_SELF_REPORT)
        if action is PeerDownAction.PROBE:
            log.info("peer %s reports %s down; probing", short_id(stream.peer_id), short_id(reported))
            self._suspect(reported, reporter=stream.peer_id)

    async def _serve_peer_leaving(self, stream: FramedStream) -> None:
        notice = await read_message(stream, mesh.PeerLeaving, self.config.gossip_timeout)
        validate_peer_leaving(notice)
        action = resolve_peer_leaving(leaving_id=bytes(notice.peer_id), authenticated_peer_id=stream.peer_id)
        if action is PeerLeavingAction.REJECT_FORGED:
            # Logged (rate-limited) by the dispatcher with the stream refusal.
            named = short_id(bytes(notice.peer_id))
            raise MeshRefusal(mesh.MESH_ERROR_SENDER_MISMATCH, f"forged PeerLeaving naming {named}")
        self._drop(stream.peer_id, "left the mesh", close_link=False)

    async def _send_leaving(self, link: PeerLink) -> None:
        notice = mesh.PeerLeaving(peer_id=self.node_id, gen=NODE_PROTOCOL_GENERATION).SerializeToString()
        try:
            # The peer ends the stream once it has dropped us.
            await request_reply(link, StreamType.PEER_LEAVING, notice, timeout=self.config.leave_timeout)
        except PEER_FAILURES as exc:
            log.debug(
                "PeerLeaving to %s not confirmed: %s", short_id(link.peer_id), exc or type(exc).__name__
            )

    def _drop(self, peer_id: bytes, reason: str, *, close_link: bool) -> bool:
        if not self.state.remove_peer(peer_id, reason=reason, now_ns=time.monotonic_ns()):
            return False
        log.info("dropped peer %s: %s", short_id(peer_id), reason)
        link = self._links.get(peer_id)
        if close_link and link is not None:
            link.close(f"dropped: {reason}")
        return True

    # -- persistence and status ---------------------------------------------------------

    def revoked_refusals(self) -> dict[str, int]:
        """Refusals of revoked or expired credentials, by code name (gossip frames and streams)."""
        counts = dict.fromkeys(sorted(mesh.MeshErrorCode.Name(c) for c in REVOCATION_CODES), 0)
        for source in (self.state.gate.revoked_refusals, self.dispatcher.refusals):
            for name in counts:
                counts[name] += source.get(name, 0)
        return counts

    def status(self) -> StatusReport:
        """What ``meshnode status`` shows; its ``to_json()`` is what the status socket serves."""
        return node_status(self)


__all__ = [
    "DEFAULT_LISTEN",
    "DEFAULT_PORT",
    "JoinError",
    "Node",
    "NodeConfig",
    "PeerUnreachable",
]
