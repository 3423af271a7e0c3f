"""The relay's state machine: registration, forwarding, queues, limits. Sans-IO.

The QUIC edge (``relay.server``) feeds it decoded events and asks it what to
write, in the convention of :mod:`meshnode.sansio` (``now_ns`` is monotonic
nanoseconds; wall-clock time only where a membership proof is checked). Per
connection:

* ``connection_made(conn, tls_peer_id, now_ns, source=host, address=host_port)``
  queues a fresh challenge, or refuses a connection over the caps; the client is
  told ``address`` when it registers (``RelayRegistered.observed_address``), and
  again by ``address_changed(conn, host_port)`` when its path moves.
* ``max_frame_bytes(conn)`` is the largest frame to accept from the client
  now: a registration's size until it has registered.
* ``receive_frame(conn, body, now_ns, unix_now=...)`` handles one client frame;
  ``stream_failed(conn, refusal)`` closes a client whose byte stream the edge
  gave up on (oversized or stalled frame, buffer cap).
  Afterwards ``read_delay_ns(conn, now_ns)`` says how long to stop reading from
  that client (its rate buckets are in debt: the client is slowed, never dropped).
* ``next_frame(conn)`` is the next frame body to write to the client (control
  messages first, then deliveries in fair order), or ``None``. The edge pulls it
  only while the client's QUIC send backlog has room, so a slow reader leaves
  its frames here, in bounded queues, and never blocks the relay.
* ``take_events()`` gives a :class:`FramesReady` for each connection that got
  something to write; ``is_closing(conn)`` tells the edge to close once
  ``next_frame`` is empty.
* ``connection_lost(conn)``; ``handle_timer(now_ns)`` / ``get_timer()``.

Policies (each has a test in ``tests/relay/test_relay_core.py``):

* Only mesh members register: the TLS key must equal the claimed node id, the
  challenge signature must verify, and the membership proof must verify for a
  mesh this relay serves, with the relay's id as the invite verifier.
* Anyone can connect, so a connection that has not registered costs little and
  is capped: its only frame may be registration-sized, it has
  ``registration_timeout_s`` to register, and at most
  ``max_unregistered`` such connections exist at once, at most
  ``max_unregistered_per_source`` from one source address (an IPv6 /64 counts
  as one address); the rest are refused with ``RELAY_ERROR_OVERLOADED``.
* A second registration of a node id wins: the older connection is told
  ``RELAY_ERROR_REPLACED`` and closed; frames queued for the id stay queued for
  the new connection (senders address ids, not connections).
* A frame goes to the destination's queue only if the sender's share of it, the
  queue and the relay-wide budget all have room; otherwise the sender gets
  ``RELAY_ERROR_QUEUE_FULL`` for that frame. Frames to an id that is not
  registered in the sender's mesh are refused with ``DESTINATION_UNKNOWN``.
* When a registration ends, its queue is dropped and every client that sent to
  it is told ``peer_gone``.
* Removals: a registered client hands over the admin-signed revocations it knows
  (``RelayRevocations``); each is verified against the mesh key of the client's
  mesh and kept (``revocations_changed`` tells the edge to save them). A removed
  node's registration is ended and any later one refused with
  ``RELAY_ERROR_NOT_A_MEMBER`` carrying ``MESH_ERROR_REVOKED``; a withdrawn
  invite's proof with ``MESH_ERROR_INVITE_REVOKED``; an expired certificate is
  refused by the membership check itself (``MESH_ERROR_CERTIFICATE_EXPIRED``).
"""

from __future__ import annotations

import ipaddress
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NODE_ID_BYTES, short_id, verify_signature
from meshnode.membership.credentials import verify_membership_proof
from meshnode.membership.revocation import RevocationList, Revoked
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import RelayRefused, relay
from meshnode.relaywire.ratelimit import TokenBucket
from meshnode.sansio import SECOND_NS
from meshnode.wire.errors import FrameTooLarge
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh
from relay.fair_queue import FairQueue

MiB = 1024 * 1024
# Bookkeeping cost charged per queued frame on top of its bytes, so floods of
# empty frames are bounded by the byte budgets too.
FRAME_OVERHEAD_BYTES = 64


@dataclass(frozen=True)
class RelayPolicy:
    max_payload_bytes: int = p.MAX_PAYLOAD_BYTES
    # Queued bytes one sender may hold for one destination; must fit one maximal frame.
    source_queue_bytes: int = 16 * MiB
    destination_queue_bytes: int = 64 * MiB
    total_queue_bytes: int = 512 * MiB
    quantum_bytes: int = 64 * 1024
    rate_bytes_per_s: int = 256 * MiB
    burst_bytes: int = 32 * MiB
    rate_frames_per_s: int = 100_000
    burst_frames: int = 20_000
    # QUIC PING interval; under the 30 s Linux UDP NAT timeout.
    keepalive_s: float = 10.0
    registration_timeout_s: float = 10.0
    max_connections: int = 4096
    # Connections not registered yet (each may hold one registration-sized frame).
    max_unregistered: int = 1024
    # ...of those, from one source address: a household or office behind one NAT
    # reconnecting at once fits; a stranger opening thousands does not.
    max_unregistered_per_source: int = 16
    # Control messages (refusals, peer-gone) waiting for a client that does not read.
    max_control_backlog: int = 4096

    def __post_init__(self) -> None:
        if self.source_queue_bytes < self.max_payload_bytes + p.ENVELOPE_ALLOWANCE:
            raise ValueError("source_queue_bytes must hold one maximal frame")
        if not self.source_queue_bytes <= self.destination_queue_bytes <= self.total_queue_bytes:
            raise ValueError("queue budgets must satisfy source <= destination <= total")
        if not 0 < self.keepalive_s < 30:
            raise ValueError("keepalive must be under 30 s (UDP NAT mappings expire after 30 s)")
        if not 0 < self.max_unregistered_per_source <= self.max_unregistered:
            raise ValueError("unregistered caps must satisfy 0 < per source <= total")

    def to_pb(self) -> relay.RelayLimits:
        return relay.RelayLimits(
            max_payload_bytes=self.max_payload_bytes,
            rate_bytes_per_s=self.rate_bytes_per_s,
            burst_bytes=self.burst_bytes,
            rate_frames_per_s=self.rate_frames_per_s,
            burst_frames=self.burst_frames,
            source_queue_bytes=self.source_queue_bytes,
            keepalive_ms=int(self.keepalive_s * 1000),
        )


@dataclass(frozen=True, slots=True)
class FramesReady:
    """``conn_id`` has frames for :meth:`RelayCore.next_frame` (its refusal, if it is closing)."""

    conn_id: int


class ConnState(Enum):
    AWAITING_REGISTER = "awaiting-register"
    REGISTERED = "registered"
    CLOSING = "closing"


@dataclass
class _Conn:
    conn_id: int
    tls_peer_id: bytes
    challenge: bytes
    created_ns: int
    byte_bucket: TokenBucket
    frame_bucket: TokenBucket
    state: ConnState = ConnState.AWAITING_REGISTER
    node_id: bytes = b""
    mesh_id: str = ""
    # The source address group it counts against while not registered ("" once registered).
    unregistered_source: str = ""
    control: deque[bytes] = field(default_factory=deque)
    # Destinations this client sent to: they get a peer_gone when it goes.
    sent_to: set[bytes] = field(default_factory=set)
    # Where the connection comes from ("host:port"), as the client is told.
    address: str = ""


@dataclass
class _Registration:
    conn_id: int
    mesh_id: str
    queue: FairQueue


@dataclass
class RelayStats:
    registrations: int = 0
    refused_registrations: int = 0
    replaced: int = 0
    frames_forwarded: int = 0
    bytes_forwarded: int = 0
    refused_frames: dict[str, int] = field(default_factory=dict)
    queued_bytes: int = 0
    connections: int = 0
    unregistered: int = 0
    # Connections the relay closed with a refusal, by RelayErrorCode name.
    connections_refused: dict[str, int] = field(default_factory=dict)


class RelayCore:
    def __init__(
        self,
        relay_id: bytes,
        meshes: set[str] | frozenset[str],
        policy: RelayPolicy | None = None,
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        revocations: Iterable[membership.Revocation] = (),
    ) -> None:
        if len(relay_id) != NODE_ID_BYTES:
            raise ValueError("relay id must be 32 bytes")
        if not meshes:
            raise ValueError("a relay serves at least one mesh")
        self.relay_id = relay_id
        self.meshes = frozenset(meshes)
        self.policy = policy or RelayPolicy()
        self._random_bytes = random_bytes
        self._conns: dict[int, _Conn] = {}
        self._registered: dict[bytes, _Registration] = {}
        self._wakeups: set[int] = set()
        self._queued_total = 0
        self._unregistered_by_source: Counter[str] = Counter()
        self._shutting_down = False
        self.stats = RelayStats()
        self._revocations = {mesh_id: RevocationList(mesh_id) for mesh_id in self.meshes}
        self._learn_revocations(revocations)
        # Set when a revocation was learned since the edge last saved them.
        self.revocations_changed = False

    def revocations(self) -> list[membership.Revocation]:
        """Every verified revocation this relay keeps, of all its meshes."""
        return [r for revocations in self._revocations.values() for r in revocations.signed()]

    def _learn_revocations(self, revocations: Iterable[membership.Revocation]) -> None:
        """Keep the stored ones that verify for a mesh this relay serves (each list refuses the rest)."""
        stored = list(revocations)
        for known in self._revocations.values():
            known.learn(stored)

    # -- inputs ------------------------------------------------------------------

    def connection_made(
        self, conn_id: int, tls_peer_id: bytes, now_ns: int, *, source: str = "", address: str = ""
    ) -> None:
        """``source``: the client's IP address (the caps on unregistered connections group by it);
        ``address``: its ``host:port``, told to the client when it registers."""
        if conn_id in self._conns:
            raise ValueError(f"connection {conn_id} already known")
        policy = self.policy
        conn = _Conn(
            conn_id=conn_id,
            tls_peer_id=tls_peer_id,
            challenge=self._random_bytes(p.CHALLENGE_BYTES),
            created_ns=now_ns,
            byte_bucket=TokenBucket.full(policy.rate_bytes_per_s, policy.burst_bytes, now_ns),
            frame_bucket=TokenBucket.full(policy.rate_frames_per_s, policy.burst_frames, now_ns),
            address=address,
        )
        self._conns[conn_id] = conn
        self.stats.connections = len(self._conns)
        if self._shutting_down:
            # The endpoint still accepts while the last refusals flush; a client that
            # reconnects then must not register with a relay that is going away.
            self._fail(conn, RelayRefused(p.SHUTTING_DOWN, "relay is shutting down"))
            return
        if len(self._conns) > policy.max_connections:
            self._fail(conn, RelayRefused(p.OVERLOADED, "relay connection budget used up"))
            return
        group = source_group(source)
        if self.stats.unregistered >= policy.max_unregistered:
            self._fail(conn, RelayRefused(p.OVERLOADED, "too many connections waiting to register"))
            return
        if self._unregistered_by_source[group] >= policy.max_unregistered_per_source:
            self._fail(
                conn, RelayRefused(p.OVERLOADED, "too many unregistered connections from this address")
            )
            return
        self._unregistered_by_source[group] += 1
        self.stats.unregistered += 1
        conn.unregistered_source = group
        challenge = relay.RelayChallenge(
            version=p.RELAY_PROTOCOL_VERSION,
            relay_id=self.relay_id,
            challenge=conn.challenge,
            limits=policy.to_pb(),
        )
        self._control(conn, relay.RelayServerMessage(challenge=challenge))

    def receive_frame(self, conn_id: int, body: bytes, now_ns: int, *, unix_now: float) -> None:
        """One frame body from the client. ``unix_now`` (wall-clock seconds) is what a
        registration's membership proof is checked against; nothing else reads it."""
        conn = self._conns.get(conn_id)
        if conn is None or conn.state is ConnState.CLOSING:
            return
        limit = self.max_frame_bytes(conn_id)
        if len(body) > limit:
            # The edge refuses such a frame on its length prefix already; this is the rule itself.
            registered = conn.state is ConnState.REGISTERED
            self._fail(
                conn, p.refusal_for_framing_error(FrameTooLarge(len(body), limit), registered=registered)
            )
            return
        try:
            message = p.decode_client_message(body, max_payload_bytes=self.policy.max_payload_bytes)
        except p.PayloadTooLarge as refusal:
            # Well framed but too big: refuse this frame, keep the client.
            if conn.state is ConnState.REGISTERED:
                self._refuse_frame(conn, refusal.send, refusal)
            else:
                self._fail(conn, refusal)
            return
        except RelayRefused as refusal:
            self._fail(conn, refusal)
            return
        # Every frame costs tokens, valid or not.
        conn.frame_bucket.charge(1, now_ns)
        conn.byte_bucket.charge(len(body), now_ns)
        kind = message.WhichOneof("kind")
        if kind == "register":
            self._on_register(conn, message.register, unix_now)
        elif conn.state is not ConnState.REGISTERED:
            self._fail(conn, RelayRefused(p.PROTOCOL, "send before registration"))
        elif kind == "revocations":
            self._on_revocations(conn, message.revocations)
        else:
            self._on_send(conn, message.send)

    def _on_revocations(self, conn: _Conn, message: relay.RelayRevocations) -> None:
        # Only revocations of the sender's own mesh: one mesh's member cannot feed another's list.
        known = self._revocations[conn.mesh_id]
        for revoked in known.learn(message.revocations).new:
            self.revocations_changed = True
            if revoked.kind == "node":
                self._end_revoked(revoked, conn.mesh_id)

    def _end_revoked(self, revoked: Revoked, mesh_id: str) -> None:
        registration = self._registered.get(revoked.target)
        if registration is None or registration.mesh_id != mesh_id:
            return
        conn = self._conns.get(registration.conn_id)
        if conn is not None:
            # With the signed revocation: it may be the only way the removed node hears why.
            refusal = RelayRefused(
                p.NOT_A_MEMBER,
                revoked.describe(),
                membership_error=mesh.MESH_ERROR_REVOKED,
                revocation=revoked.signed,
            )
            self._fail(conn, refusal)

    def address_changed(self, conn_id: int, address: str) -> None:
        """``conn_id`` now comes from ``address`` (its NAT remapped it, or it moved): a registered
        client is told, since that is where its peers can punch to it now."""
        conn = self._conns.get(conn_id)
        if conn is None or conn.address == address:
            return
        conn.address = address
        if conn.state is ConnState.REGISTERED:
            observed = relay.RelayObserved(observed_address=address)
            self._control(conn, relay.RelayServerMessage(observed=observed))

    def stream_failed(self, conn_id: int, refusal: RelayRefused) -> None:
        """The edge stopped reading ``conn_id``'s stream; tell the client why, then close."""
        conn = self._conns.get(conn_id)
        if conn is not None:
            self._fail(conn, refusal)

    def connection_lost(self, conn_id: int) -> None:
        conn = self._conns.pop(conn_id, None)
        self._wakeups.discard(conn_id)
        self.stats.connections = len(self._conns)
        if conn is None:
            return
        self._count_registered(conn)
        if not conn.node_id:
            return
        registration = self._registered.get(conn.node_id)
        if registration is not None and registration.conn_id == conn_id:
            self._unregister(conn.node_id, "disconnected from the relay")

    def handle_timer(self, now_ns: int) -> None:
        timeout_ns = self._registration_timeout_ns()
        for conn in list(self._conns.values()):
            if conn.state is ConnState.AWAITING_REGISTER and now_ns - conn.created_ns >= timeout_ns:
                self._fail(
                    conn,
                    RelayRefused(
                        p.REGISTRATION_TIMEOUT,
                        f"no registration within {self.policy.registration_timeout_s:g} s",
                    ),
                )

    def get_timer(self) -> int | None:
        waiting = [c.created_ns for c in self._conns.values() if c.state is ConnState.AWAITING_REGISTER]
        return min(waiting) + self._registration_timeout_ns() if waiting else None

    def _registration_timeout_ns(self) -> int:
        return round(self.policy.registration_timeout_s * SECOND_NS)

    def shutdown(self) -> None:
        self._shutting_down = True
        for conn in list(self._conns.values()):
            self._fail(conn, RelayRefused(p.SHUTTING_DOWN, "relay is shutting down"))

    # -- outputs -----------------------------------------------------------------

    def next_frame(self, conn_id: int) -> bytes | None:
        conn = self._conns.get(conn_id)
        if conn is None:
            return None
        if conn.control:
            return conn.control.popleft()
        if conn.state is not ConnState.REGISTERED:
            return None
        registration = self._registered[conn.node_id]
        item = registration.queue.pop()
        if item is None:
            return None
        _source, frame = item
        self._queued_total -= registration.queue.cost(frame)
        self.stats.queued_bytes = self._queued_total
        self.stats.frames_forwarded += 1
        self.stats.bytes_forwarded += len(frame)
        return frame

    def take_events(self) -> list[FramesReady]:
        """The connections that got something to write since the last call, each once."""
        wakeups, self._wakeups = self._wakeups, set()
        return [FramesReady(conn_id) for conn_id in wakeups]

    def read_delay_ns(self, conn_id: int, now_ns: int) -> int:
        conn = self._conns.get(conn_id)
        if conn is None:
            return 0
        return max(conn.byte_bucket.debt_delay_ns(now_ns), conn.frame_bucket.debt_delay_ns(now_ns))

    def max_frame_bytes(self, conn_id: int) -> int:
        conn = self._conns.get(conn_id)
        if conn is not None and conn.state is ConnState.REGISTERED:
            return p.MAX_RELAY_FRAME_BYTES
        return p.MAX_REGISTRATION_FRAME_BYTES

    def unregistered_from(self, source: str) -> int:
        return self._unregistered_by_source[source_group(source)]

    def is_closing(self, conn_id: int) -> bool:
        conn = self._conns.get(conn_id)
        return conn is None or conn.state is ConnState.CLOSING

    def registered_node(self, conn_id: int) -> bytes | None:
        conn = self._conns.get(conn_id)
        return conn.node_id if conn is not None and conn.state is ConnState.REGISTERED else None

    def queued_bytes_for(self, node_id: bytes) -> int:
        registration = self._registered.get(node_id)
        return registration.queue.nbytes if registration is not None else 0

    def registered_count(self) -> int:
        """Node ids registered now: the members this relay forwards for."""
        return len(self._registered)

    def registered_members(self) -> list[tuple[bytes, str]]:
        """(node id, mesh id) of each member registered now."""
        return [(node_id, registration.mesh_id) for node_id, registration in self._registered.items()]

    def queued_frames(self) -> int:
        """Frames waiting for their destinations, all queues."""
        return sum(len(registration.queue) for registration in self._registered.values())

    # -- registration ----------------------------------------------------------------

    def _on_register(self, conn: _Conn, register: relay.RelayRegister, unix_now: float) -> None:
        if conn.state is not ConnState.AWAITING_REGISTER:
            self._fail(conn, RelayRefused(p.PROTOCOL, "already registered"))
            return
        node_id = bytes(register.node_id)
        if node_id != conn.tls_peer_id:
            self._refuse_registration(
                conn,
                RelayRefused(p.IDENTITY_MISMATCH, "node id is not the key this connection authenticated"),
            )
            return
        message = p.registration_message(self.relay_id, conn.challenge, node_id, register.mesh_id)
        if not verify_signature(node_id, bytes(register.signature), message):
            self._refuse_registration(
                conn, RelayRefused(p.BAD_SIGNATURE, "challenge signature does not verify")
            )
            return
        if register.mesh_id not in self.meshes:
            self._refuse_registration(
                conn,
                RelayRefused(
                    p.NOT_A_MEMBER,
                    "this relay does not serve that mesh",
                    membership_error=mesh.MESH_ERROR_OTHER_MESH,
                ),
            )
            return
        proof: membership.MembershipProof | None = (
            register.membership_proof if register.HasField("membership_proof") else None
        )
        try:
            verified = verify_membership_proof(
                proof,
                mesh_id=register.mesh_id,
                verifier_id=self.relay_id,
                authenticated_peer_id=node_id,
                unix_now=unix_now,
            )
            self._revocations[register.mesh_id].refuse_revoked(node_id, verified)
        except MeshRefusal as refusal:
            revoked = self._revocations[register.mesh_id].node(node_id)
            self._refuse_registration(
                conn,
                RelayRefused(
                    p.NOT_A_MEMBER,
                    refusal.detail,
                    membership_error=refusal.code,
                    revocation=revoked.signed if revoked is not None else None,
                ),
            )
            return
        self._register(conn, node_id, register.mesh_id)

    def _register(self, conn: _Conn, node_id: bytes, mesh_id: str) -> None:
        registration = self._registered.get(node_id)
        if registration is not None:
            old = self._conns.get(registration.conn_id)
            if old is not None:
                old.node_id = b""  # no longer the registration: its loss must not unregister the id
                self._fail(old, RelayRefused(p.REPLACED, "a newer connection registered this node id"))
            self.stats.replaced += 1
            if registration.mesh_id == mesh_id:
                # Newest wins and inherits the queue: senders address ids, not connections.
                registration.conn_id = conn.conn_id
                if registration.queue.nframes:
                    self._wakeups.add(conn.conn_id)
            else:
                self._unregister(node_id, "re-registered in another mesh")
                registration = None
        if registration is None:
            self._registered[node_id] = _Registration(
                conn_id=conn.conn_id,
                mesh_id=mesh_id,
                queue=FairQueue(self.policy.quantum_bytes, FRAME_OVERHEAD_BYTES),
            )
        conn.state = ConnState.REGISTERED
        conn.node_id = node_id
        conn.mesh_id = mesh_id
        self._count_registered(conn)
        self.stats.registrations += 1
        registered = relay.RelayRegistered(node_id=node_id, mesh_id=mesh_id, observed_address=conn.address)
        self._control(conn, relay.RelayServerMessage(registered=registered))

    def _refuse_registration(self, conn: _Conn, refusal: RelayRefused) -> None:
        self.stats.refused_registrations += 1
        self._fail(conn, refusal)

    def _unregister(self, node_id: bytes, reason: str) -> None:
        registration = self._registered.pop(node_id)
        self._queued_total -= registration.queue.clear()
        self.stats.queued_bytes = self._queued_total
        gone = relay.RelayServerMessage(peer_gone=relay.RelayPeerGone(peer_id=node_id, reason=reason))
        for conn in self._conns.values():
            if node_id in conn.sent_to:
                conn.sent_to.discard(node_id)
                if conn.state is ConnState.REGISTERED:
                    self._control(conn, gone)

    # -- forwarding ---------------------------------------------------------------

    def _on_send(self, conn: _Conn, send: relay.RelaySend) -> None:
        destination = bytes(send.destination_id)
        registration = self._registered.get(destination)
        if registration is None or registration.mesh_id != conn.mesh_id:
            self._refuse_frame(
                conn,
                send,
                RelayRefused(p.DESTINATION_UNKNOWN, f"{short_id(destination)} is not registered here"),
            )
            return
        frame = p.encode_deliver(conn.node_id, send.channel, send.payload)
        queue = registration.queue
        cost = queue.cost(frame)
        policy = self.policy
        if queue.source_bytes(conn.node_id) + cost > policy.source_queue_bytes:
            reason = "sender's share of the destination queue is full"
        elif queue.nbytes + cost > policy.destination_queue_bytes:
            reason = "destination queue is full"
        elif self._queued_total + cost > policy.total_queue_bytes:
            reason = "relay queue budget is full"
        else:
            queue.push(conn.node_id, frame, send.channel)
            self._queued_total += cost
            self.stats.queued_bytes = self._queued_total
            conn.sent_to.add(destination)
            self._wakeups.add(registration.conn_id)
            return
        self._refuse_frame(conn, send, RelayRefused(p.QUEUE_FULL, reason))

    def _refuse_frame(self, conn: _Conn, send: relay.RelaySend, refusal: RelayRefused) -> None:
        name = refusal.code_name
        self.stats.refused_frames[name] = self.stats.refused_frames.get(name, 0) + 1
        refused = relay.RelaySendRefused(
            send_id=send.send_id,
            destination_id=send.destination_id,
            channel=send.channel,
            refusal=refusal.to_pb(),
        )
        self._control(conn, relay.RelayServerMessage(send_refused=refused))

    # -- helpers --------------------------------------------------------------------

    def _control(self, conn: _Conn, message: relay.RelayServerMessage) -> None:
        if len(conn.control) >= self.policy.max_control_backlog:
            # The client does not read what it is told; it gets no more of our memory.
            conn.control.clear()
            self._fail(conn, RelayRefused(p.OVERLOADED, "client does not read relay messages"))
            return
        conn.control.append(message.SerializeToString())
        self._wakeups.add(conn.conn_id)

    def _count_registered(self, conn: _Conn) -> None:
        """``conn`` no longer counts against the caps on unregistered connections."""
        group, conn.unregistered_source = conn.unregistered_source, ""
        if not group:
            return
        self.stats.unregistered -= 1
        self._unregistered_by_source[group] -= 1
        if not self._unregistered_by_source[group]:
            del self._unregistered_by_source[group]

    def _fail(self, conn: _Conn, refusal: RelayRefused) -> None:
        """Send ``refusal`` as the connection's last message and close it."""
        if conn.state is ConnState.CLOSING:
            return
        name = refusal.code_name
        self.stats.connections_refused[name] = self.stats.connections_refused.get(name, 0) + 1
        node_id = conn.node_id
        conn.state = ConnState.CLOSING
        conn.control.append(relay.RelayServerMessage(refused=refusal.to_pb()).SerializeToString())
        self._wakeups.add(conn.conn_id)
        if node_id:
            registration = self._registered.get(node_id)
            if registration is not None and registration.conn_id == conn.conn_id:
                self._unregister(node_id, f"connection closed ({refusal.code_name})")


def source_group(host: str) -> str:
    """The address the unregistered caps count by: the IPv4 address, or the IPv6 /64.

    One IPv6 host commonly holds a whole /64, so counting single IPv6 addresses
    would give it 2**64 quotas.
    """
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


__all__ = ["ConnState", "FramesReady", "RelayCore", "RelayPolicy", "RelayStats", "source_group"]
