"""The node runtime: identity + QUIC transport + dispatcher + membership, on asyncio.

Protocol decisions live in :mod:`meshnode.mesh` (pure); :class:`Node` composes the parts
that move frames between streams and :class:`~meshnode.mesh.state.MeshState`, each owning
its own state and given the objects it reads:

* :mod:`meshnode.node.peer_connections` — the link kept per peer, and the dialer;
* :mod:`meshnode.node.gossip` — the gossip exchanges, the links on which one completed
  (``get_link``), and what they taught spread at once;
* :mod:`meshnode.node.bootstrap` — joining with an invite, reconnecting after a restart;
* :mod:`meshnode.node.heartbeat` — the state's timer: gossip rounds, stale peers;
* :mod:`meshnode.node.liveness` — suspected peers probed and dropped, PEER_DOWN,
  PEER_LEAVING and PROBE; whether a peer still answers is
  :mod:`meshnode.node.reachability`'s; under delta gossip (:mod:`meshnode.node.delta_gossip`)
  :mod:`meshnode.node.swim` finds dead members instead of the records' heartbeats;
* :mod:`meshnode.node.membership_keeper` — revocations, renewals, this node's own removal
  (``node.removal`` is set, with ``node.removal_reason``, once this node is out of the
  mesh), and the membership on disk;
* :mod:`meshnode.node.evidence_keeper` — audit evidence verified, kept and spread on gossip
  (``node.evidence``; ``node.evidence.report(evidence)`` when this node's head convicts);
* :mod:`meshnode.node.status_report` and :mod:`meshnode.statussocket.server` — the status
  report and its socket; :mod:`meshnode.node.status_sections` — what it shows besides the
  mesh.

It gives the state two clocks, as :mod:`meshnode.sansio` says: ``time.monotonic_ns()``
for liveness, and ``time.time()`` beside it where a credential or a record's
incarnation is checked.

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
import logging
import socket
import time
from collections.abc import Collection, Mapping
from typing import Any

from meshnode import __version__
from meshnode.gen.meshnode.v1.audit_pb2 import AuditEvidence
from meshnode.identity import NodeIdentity
from meshnode.membership.credentials import Endpoint, Invite
from meshnode.membership.relay_list import merge_relays
from meshnode.membership.store import DataDir, MembershipState
from meshnode.mesh.credential_gate import REVOCATION_CODES
from meshnode.mesh.dispatcher import Dispatcher, StreamHandler
from meshnode.mesh.peer_dialer import PeerUnreachable
from meshnode.mesh.peer_table import PeerEntry
from meshnode.mesh.state import MeshState
from meshnode.mesh.validation import MAX_PEERS_PER_FRAME
from meshnode.node.background_tasks import BackgroundTasks
from meshnode.node.bootstrap import Bootstrap
from meshnode.node.config import DEFAULT_LISTEN, DEFAULT_PORT, JoinError, NodeConfig
from meshnode.node.delta_gossip import DeltaGossip
from meshnode.node.evidence_keeper import EvidenceKeeper
from meshnode.node.gossip import Gossip
from meshnode.node.heartbeat import Heartbeat
from meshnode.node.liveness import Liveness
from meshnode.node.membership_keeper import MembershipKeeper, load_revocations
from meshnode.node.peer_connections import PeerConnections
from meshnode.node.reachability import Reachability
from meshnode.node.status_report import StatusReport, node_status
from meshnode.node.status_sections import SectionProvider, StatusSections
from meshnode.node.swim import SwimLiveness
from meshnode.relaylink.manager import RelayLinks
from meshnode.sansio import SECOND_NS
from meshnode.statussocket.server import StatusServer
from meshnode.transport.addresses import format_host_port, parse_host_port
from meshnode.transport.base import MeshStream, PeerLink
from meshnode.transport.local_addresses import default_advertised
from meshnode.transport.quic import QuicEndpoint
from meshnode.traversal.direct_paths import DirectPaths
from meshnode.wire.framing import StreamType
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)


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
            role=config.role,
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
            # Under delta gossip a GossipFrame only admits (the digest brings the table), and SWIM
            # probes find dead members: a record changes only when its content does.
            frame_table_limit=0 if config.delta_gossip else MAX_PEERS_PER_FRAME - 1,
            max_peers=config.max_peers,
            record_heartbeats=not config.delta_gossip,
            frame_revocations=not config.delta_gossip,
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
        self.endpoint: QuicEndpoint | None = None
        self.relay_links: RelayLinks | None = None
        self.started_at_ns = time.monotonic_ns()
        # Peers to dial by address besides the peer table's: the stored known peers, or the invite's.
        self._known_peers = known_peers
        self._connections = PeerConnections(
            identity.node_id,
            announcement_of=self.state.table.announcement_of,
            known_peers=known_peers,
            race_window=config.link_race_window,
            connect_timeout=config.connect_timeout,
            relay_only=config.relay_only,
        )
        # Direct paths to peers behind NAT: punching, the LAN shortcut, their watch.
        self.traversal = DirectPaths(
            self.state,
            self._connections.links,
            lambda: self.relay_links,
            config.traversal,
            relay_only=config.relay_only,
        )
        self._background = BackgroundTasks()
        self.keeper = MembershipKeeper(self.state, data_dir, known_peers)
        # Set once this node is out of the mesh (removed, or its certificate expired); see keeper.
        self.removal = self.keeper.removal
        self._reachability = Reachability(self, self.traversal)
        self._liveness = Liveness(
            self.state,
            self._connections,
            self._reachability,
            self._background,
            gossip_timeout=config.gossip_timeout,
            probe_timeout=config.probe_timeout,
            leave_timeout=config.leave_timeout,
        )
        self.gossip = Gossip(
            self.state,
            self.keeper,
            self._connections,
            self._liveness,
            self._background,
            known_peers,
            gossip_timeout=config.gossip_timeout,
            connect_timeout=config.connect_timeout,
            evidence=EvidenceKeeper(identity, mesh_id, data_dir),
        )
        # Audit evidence held (verified) and spread: the head's routes leave its accused out.
        self.evidence = self.gossip.evidence
        self.delta_gossip = (
            DeltaGossip(
                self.state,
                self.gossip,
                SwimLiveness(
                    self.state,
                    self._liveness,
                    self._reachability,
                    self.gossip.get_link,
                    self._background,
                    probe_timeout=config.probe_timeout,
                    connect_timeout=config.connect_timeout,
                ),
                self._connections.links,
                self._background,
                fanout=config.gossip_fanout,
                active_view=config.active_view,
                gossip_timeout=config.gossip_timeout,
                connect_timeout=config.connect_timeout,
            )
            if config.delta_gossip
            else None
        )
        if self.delta_gossip is not None:
            # What a node learns (a revocation) spreads by digest with its view, not to everyone.
            self.gossip.spread = self.delta_gossip.gossip_now
            self.gossip.spread_evidence = self.delta_gossip.evidence_now
        self._heartbeat = Heartbeat(self.state, self.keeper, self.gossip, self._liveness, self.delta_gossip)
        self._bootstrap = Bootstrap(
            self.state, self.keeper, self._connections, self.gossip, self._background, known_peers
        )
        self.dispatcher = Dispatcher(
            is_admitted=self.state.is_admitted,
            stream_type_timeout=config.stream_type_timeout,
            check_peer=self.state.revocations.check_node,
        )
        self.dispatcher.register(StreamType.GOSSIP, self.gossip.serve, before_admission=True)
        self.dispatcher.register(
            StreamType.ROUTE_REQUEST, self.gossip.serve_route_request, before_admission=True
        )
        self.dispatcher.register(StreamType.PEER_DOWN, self._liveness.serve_peer_down)
        self.dispatcher.register(StreamType.PEER_LEAVING, self._liveness.serve_peer_leaving)
        if self.delta_gossip is not None:
            self.dispatcher.register(StreamType.GOSSIP_DIGEST, self.delta_gossip.serve)
            # SWIM's indirect probes besides the echo.
            self.dispatcher.register(StreamType.PROBE, self.delta_gossip.swim.serve_probe)
        else:
            self.dispatcher.register(StreamType.PROBE, self._liveness.serve_probe)
        self.dispatcher.register(StreamType.HOLE_PUNCH, self.traversal.serve_punch)
        self._status_server: StatusServer | None = None
        # Its API's address (for `meshnode generate`) and the sections the head adds.
        self._status_sections = StatusSections()
        self._stopped = False

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
        return self._status_sections.api_url

    def set_api_url(self, url: str) -> None:
        self._status_sections.set_api_url(url)

    @property
    def status_sections(self) -> Mapping[str, SectionProvider]:
        return self._status_sections.sections

    def add_status_section(self, name: str, provider: SectionProvider) -> None:
        """Show ``provider()`` as the status report's section ``name`` (replacing one so named)."""
        self._status_sections.add(name, provider)

    def remove_status_section(self, name: str) -> None:
        self._status_sections.remove(name)

    def report_conviction(self, evidence: AuditEvidence) -> None:
        """This node's head convicted a node: the evidence, signed by this node, spreads at once."""
        self.evidence.report(evidence)
        self.gossip.spread_learned()

    @property
    def gossip_refusals(self) -> Mapping[str, int]:
        """Gossip frames refused, by code name."""
        return self.gossip.refusals

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

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        host, port = parse_host_port(self.config.listen, allow_zero_port=True)
        self.endpoint = await QuicEndpoint.listen(self.identity, self, host, port, self.config.quic)
        bound_host, bound_port = self.endpoint.local_address
        advertise = self.config.advertise or default_advertised(bound_host, bound_port)
        self.state.local.ClearField("addresses")
        self.state.local.addresses.extend(advertise)
        relay_links = await self._start_relays(self.endpoint)
        self._connections.start(self.endpoint, relay_links, shortcuts=self.traversal)
        self.traversal.start(self.endpoint, self)
        self._status_server = StatusServer(
            self.data_dir.control_socket, self.status, control=self.gossip.control
        )
        await self._status_server.start()
        self._heartbeat.start(self._background)
        self.gossip.spread_learned()  # a node whose data directory holds its own removal stops here
        log.info(
            "node %s listening on %s (QUIC %s), advertising %s; mesh %s",
            self.identity.short_id,
            format_host_port(bound_host, bound_port),
            "mesh-llm/1",
            ", ".join(advertise),
            self.mesh_id,
        )

    async def _start_relays(self, endpoint: QuicEndpoint) -> RelayLinks:
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
        if merged.changes:
            self.keeper.relays_changed(merged.relays)
        # Always present: a node with no relays of its own still reaches NATed peers through the
        # relays they announce (registered on first use, see PeerDialer.dial_peer).
        self.relay_links = relay_links = RelayLinks(
            self.identity,
            self,
            mesh_id=self.mesh_id,
            proof_for=self.state.our_proof,
            revocations=self.state.revocations.signed,
            on_revocation=self.gossip.revocation_from_relay,
            node_endpoint=endpoint,
            on_observed=self.traversal.observed_changed,
        )
        self.gossip.start(relay_links)
        await relay_links.add_relays(Endpoint(id=bytes(r.relay_id), address=r.address) for r in local.relays)
        return relay_links

    async def join(self) -> None:
        """Invite holder: dial bootstrap peers until one admits us and grants membership."""
        await self._bootstrap.join()

    async def reconnect(self) -> int:
        """Member restart: gossip with the peers we knew until one answers; returns how many had
        (the dials to the others go on)."""
        return await self._bootstrap.reconnect()

    async def shutdown(self) -> None:
        """Announce PeerLeaving to every linked peer, then close everything."""
        if self._stopped:
            return
        self._stopped = True
        await self._background.stop()
        links = self._connections.links.live()
        if links:
            await asyncio.gather(
                *(self._liveness.send_leaving(link) for link in links), return_exceptions=True
            )
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

    # -- links (the transport's LinkHandler, and what the layers above use) ------------------

    async def get_link(self, peer_id: bytes, avoid_relays: Collection[bytes] = ()) -> PeerLink:
        """A live link to ``peer_id`` on which a gossip exchange (mutual admission) completed.

        A new link does not go through ``avoid_relays`` (see :meth:`reachable`).
        """
        return await self.gossip.get_link(peer_id, avoid_relays)

    def link_to(self, peer_id: bytes) -> PeerLink | None:
        """The live link kept for ``peer_id`` (whether or not gossip has run on it yet), or ``None``."""
        return self._connections.links.get(peer_id)

    def link_established(self, link: PeerLink) -> None:
        self._connections.links.add(link)

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        self.dispatcher.accept(stream)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        was_kept = self._connections.links.remove(link)
        self.traversal.link_closed(link, was_kept=was_kept)
        self.gossip.link_closed(link)
        if was_kept and self.delta_gossip is not None:
            self.delta_gossip.link_closed(link.peer_id)

    # -- whether a peer answers ----------------------------------------------------------

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


__all__ = [
    "DEFAULT_LISTEN",
    "DEFAULT_PORT",
    "JoinError",
    "Node",
    "NodeConfig",
    "PeerUnreachable",
]
