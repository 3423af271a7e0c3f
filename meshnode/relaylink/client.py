"""The node's connection to one relay: register, send, receive, and come back after a restart.

:func:`connect_and_register` performs one registration (QUIC dial pinned to the
relay id from the invite, challenge, signed registration with a membership
proof) and returns a :class:`RelaySession`, or raises the relay's
:class:`~meshnode.relaywire.protocol.RelayRefused`.

:class:`RelayClient` keeps a registration alive: when the connection drops it
reconnects and re-registers with jittered exponential backoff (capped), and it
paces what it sends to the rate limits the relay announced, so it is never the
client the relay has to slow down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnode.cancellation import cancel_and_wait
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.identity import NodeIdentity, short_id
from meshnode.membership.credentials import Endpoint
from meshnode.relaylink.send_turns import OutgoingRecord, Sealer, SendTurns
from meshnode.relaywire import protocol as p
from meshnode.relaywire.protocol import RelayRefused, relay
from meshnode.relaywire.ratelimit import TokenBucket
from meshnode.sansio import SECOND_NS
from meshnode.transport.base import LinkClosed, MeshStream, PeerLink, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.transport.quic import DialError, PeerKeyMismatch, QuicConfig, QuicEndpoint, QuicLink
from meshnode.wire.errors import FramingError
from meshnode.wire.pb import mesh

log = logging.getLogger(__name__)

# Addresses kept per relay: the one given first, and those peers announced since.
MAX_RELAY_ADDRESSES = 4

# Pace to this fraction of the relay's announced limits (its buckets started earlier).
_PACING_MARGIN = 0.9


class RelayUnavailable(LinkClosed):
    """Not registered with the relay right now."""


class RegistrationNotNeeded(Exception):
    """A registration given up before it went out: the connection it was to replace answered."""


@dataclass(frozen=True)
class RelayClientConfig:
    connect_timeout: float = 5.0
    register_timeout: float = 5.0
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    # A relay that vanishes without closing (crash, network cut) is noticed within idle_timeout;
    # both sides ping well before it.
    quic: QuicConfig = field(
        default_factory=lambda: QuicConfig(
            alpn=p.RELAY_ALPN, idle_timeout=15.0, keepalive_interval=5.0, max_stream_unsent=p.MAX_UNSENT_BYTES
        )
    )


class Backoff:
    """Exponential backoff with full jitter, capped; ``reset()`` after a success."""

    def __init__(self, initial: float, cap: float, rng: Callable[[], float] = random.random) -> None:
        self.initial = initial
        self.cap = cap
        self._rng = rng
        self._attempt = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.initial * 2**self._attempt)
        self._attempt += 1
        # At least half the ceiling, so a herd of restarting nodes still spreads out.
        return ceiling * (0.5 + 0.5 * self._rng())

    def reset(self) -> None:
        self._attempt = 0


class RelayStreamWaiter:
    """LinkHandler for a relay connection: the relay opens the one stream."""

    def __init__(self) -> None:
        self.streams: dict[QuicLink, asyncio.Future[MeshStream]] = {}
        self.closed: dict[QuicLink, str] = {}

    def future_for(self, link: QuicLink) -> asyncio.Future[MeshStream]:
        if link not in self.streams:
            self.streams[link] = asyncio.get_running_loop().create_future()
        return self.streams[link]

    def link_established(self, link: PeerLink) -> None:
        pass

    def stream_accepted(self, link: PeerLink, stream: MeshStream) -> None:
        assert isinstance(link, QuicLink)
        future = self.future_for(link)
        if future.done():
            stream.reset(p.PROTOCOL)  # the relay opens exactly one stream
        else:
            future.set_result(stream)

    def link_closed(self, link: PeerLink, reason: str) -> None:
        assert isinstance(link, QuicLink)
        future = self.streams.pop(link, None)
        if future is not None and not future.done():
            future.set_exception(LinkClosed(reason))
            future.exception()


class RelaySession:
    """One registered connection to a relay."""

    def __init__(
        self,
        relay_id: bytes,
        node_id: bytes,
        link: QuicLink,
        framed: FramedStream,
        limits: relay.RelayLimits,
        observed_address: str = "",
    ):
        self.relay_id = relay_id
        self.node_id = node_id
        self.link = link
        self.framed = framed
        self.limits = limits
        # Where the relay sees this connection come from (RelayRegistered, then RelayObserved).
        self.observed_address = observed_address
        now_ns = time.monotonic_ns()
        self._bytes = TokenBucket.full(
            limits.rate_bytes_per_s * _PACING_MARGIN, limits.burst_bytes * _PACING_MARGIN, now_ns
        )
        self._frames = TokenBucket.full(
            limits.rate_frames_per_s * _PACING_MARGIN, limits.burst_frames * _PACING_MARGIN, now_ns
        )

    @property
    def is_closed(self) -> bool:
        return self.link.is_closed

    async def send_body(self, body: bytes) -> None:
        """Write one client frame, first waiting out the relay's rate limits."""
        now_ns = time.monotonic_ns()
        delay_ns = max(self._bytes.delay_for_ns(len(body), now_ns), self._frames.delay_for_ns(1, now_ns))
        if delay_ns > 0:
            await asyncio.sleep(delay_ns / SECOND_NS)
            now_ns = time.monotonic_ns()
        self._bytes.charge(len(body), now_ns)
        self._frames.charge(1, now_ns)
        await self.framed.send_frame(body)

    async def send(self, destination: bytes, channel: int, payload: bytes, send_id: int = 0) -> None:
        await self.send_body(p.encode_send(destination, channel, payload, send_id))

    async def recv(self, timeout: float | None = None) -> relay.RelayServerMessage | None:
        """The next relay message; ``None`` when the relay ended the stream."""
        body = await self.framed.recv_frame(timeout)
        return None if body is None else p.decode_server_message(body)

    def close(self, reason: str = "relay client closing") -> None:
        self.link.close(reason)


class RelayDialer:
    """Where relay connections leave from (the relay ALPN), and the handler that takes the relay's
    stream: the node's own QUIC socket (:meth:`shared`), or a socket of its own (:meth:`open`)."""

    def __init__(
        self,
        identity: NodeIdentity,
        endpoint: QuicEndpoint,
        waiter: RelayStreamWaiter,
        settings: QuicConfig,
        *,
        owns_endpoint: bool,
    ) -> None:
        self.identity = identity
        self.endpoint = endpoint
        self.waiter = waiter
        self.settings = settings
        self.owns_endpoint = owns_endpoint

    @classmethod
    async def open(
        cls, identity: NodeIdentity, quic: QuicConfig | None = None, host: str = "0.0.0.0"
    ) -> RelayDialer:
        waiter = RelayStreamWaiter()
        settings = dataclasses.replace(quic or QuicConfig(), alpn=p.RELAY_ALPN)
        endpoint = await QuicEndpoint.listen(identity, waiter, host, 0, settings)
        return cls(identity, endpoint, waiter, settings, owns_endpoint=True)

    @classmethod
    def shared(cls, endpoint: QuicEndpoint, quic: QuicConfig | None = None) -> RelayDialer:
        """Relay connections from the node's mesh socket: the relay then observes the address
        and port that peers behind other NATs can punch to."""
        settings = dataclasses.replace(quic or QuicConfig(), alpn=p.RELAY_ALPN)
        return cls(endpoint.identity, endpoint, RelayStreamWaiter(), settings, owns_endpoint=False)

    async def register(
        self,
        relay_endpoint: Endpoint,
        *,
        mesh_id: str,
        proof: membership.MembershipProof | None,
        connect_timeout: float = 5.0,
        register_timeout: float = 5.0,
        still_needed: Callable[[], bool] = lambda: True,
    ) -> RelaySession:
        return await connect_and_register(
            self.endpoint,
            self.waiter,
            self.identity,
            relay_endpoint,
            mesh_id=mesh_id,
            proof=proof,
            connect_timeout=connect_timeout,
            register_timeout=register_timeout,
            still_needed=still_needed,
            settings=self.settings,
        )

    def close(self) -> None:
        if self.owns_endpoint:
            self.endpoint.close()


async def connect_and_register(
    endpoint: QuicEndpoint,
    waiter: RelayStreamWaiter,
    identity: NodeIdentity,
    relay_endpoint: Endpoint,
    *,
    mesh_id: str,
    proof: membership.MembershipProof | None,
    connect_timeout: float = 5.0,
    register_timeout: float = 5.0,
    still_needed: Callable[[], bool] = lambda: True,
    settings: QuicConfig | None = None,
) -> RelaySession:
    """Dial, authenticate the relay by its pinned id, register. Raises ``RelayRefused``/``DialError``.

    ``settings``: the relay connection's QUIC settings, where ``endpoint`` is the node's own
    (default: the endpoint's, a socket opened for relay connections).

    ``still_needed`` is asked just before the registration goes out (a registration replaces
    this node's earlier one at the relay); when it says no, the new connection is closed
    unregistered and :class:`RegistrationNotNeeded` raised.
    """
    link = await endpoint.dial(
        relay_endpoint.address, relay_endpoint.id, timeout=connect_timeout, settings=settings, handler=waiter
    )
    try:
        async with asyncio.timeout(register_timeout):
            stream = await waiter.future_for(link)
            framed = FramedStream(stream, expect_stream_type=False, max_frame_bytes=p.MAX_RELAY_FRAME_BYTES)
            first = await _recv_or_refused(framed)
            if first.WhichOneof("kind") != "challenge":
                raise RelayRefused(p.PROTOCOL, f"relay sent {first.WhichOneof('kind')} before its challenge")
            challenge = first.challenge
            if challenge.relay_id != relay_endpoint.id:
                raise RelayRefused(p.PROTOCOL, "relay challenge names another relay id")
            register = relay.RelayRegister(
                node_id=identity.node_id,
                mesh_id=mesh_id,
                signature=p.sign_registration(
                    identity, relay_id=relay_endpoint.id, challenge=challenge.challenge, mesh_id=mesh_id
                ),
            )
            if proof is not None:
                register.membership_proof.CopyFrom(proof)
            if not still_needed():
                raise RegistrationNotNeeded("no longer needed")
            await framed.send_frame(relay.RelayClientMessage(register=register).SerializeToString())
            reply = await _recv_or_refused(framed)
            if reply.WhichOneof("kind") != "registered":
                raise RelayRefused(p.PROTOCOL, f"relay answered {reply.WhichOneof('kind')} to registration")
    except RegistrationNotNeeded:
        link.close("registration no longer needed")
        raise
    except TimeoutError:
        link.close("registration timed out")
        raise DialError(f"relay {relay_endpoint} did not complete registration in time") from None
    except BaseException:
        link.close("registration failed")
        raise
    return RelaySession(
        relay_endpoint.id,
        identity.node_id,
        link,
        framed,
        challenge.limits,
        observed_address=reply.registered.observed_address,
    )


async def _recv_or_refused(framed: FramedStream) -> relay.RelayServerMessage:
    try:
        body = await framed.recv_frame()
    except LinkClosed as exc:
        # The relay closes with its refusal as the reason when the frame itself did not make it.
        raise DialError(f"relay closed the connection: {exc.reason}") from None
    if body is None:
        raise DialError("relay ended the stream during registration")
    message = p.decode_server_message(body)
    if message.WhichOneof("kind") == "refused":
        raise RelayRefused.from_pb(message.refused)
    return message


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def registration_failure(exc: Exception, mesh_id: str) -> str:
    """Why registering for ``mesh_id`` failed, with the fix where the cause is a setting."""
    if isinstance(exc, PeerKeyMismatch):
        return (
            f"{exc}: the relay id given (--relay, or in the invite) is not this relay's; "
            "`meshnode relay --show-id` on the relay prints its id"
        )
    if isinstance(exc, RelayRefused) and exc.membership_error == mesh.MESH_ERROR_OTHER_MESH:
        return f"{exc}: start the relay with --mesh {mesh_id} (repeatable, one per mesh it serves)"
    return str(exc)


@dataclass
class RelayCallbacks:
    deliver: Callable[[RelayClient, bytes, int, bytes], None]
    peer_gone: Callable[[RelayClient, bytes, str], None]
    send_refused: Callable[[RelayClient, relay.RelaySendRefused], None]
    up: Callable[[RelayClient], None]
    down: Callable[[RelayClient, str], None]
    # The connection left a ping unanswered: still registered, but maybe dead (see confirm_alive).
    silent: Callable[[RelayClient, str], None]
    # The address the relay observes this node at changed (a registration, or RelayObserved).
    observed: Callable[[RelayClient, str], None] = lambda _client, _address: None


class RelayCheck(enum.Enum):
    """What RelayClient.confirm_alive found."""

    # The relay answered on the connection we had.
    ANSWERED = "answered"
    # That connection was dead (the relay restarted, or our path to it changed); a new one is registered.
    REGISTERED_AGAIN = "registered again"
    # Neither, within the time given.
    AWAY = "away"


class RelayClient:
    """Keeps this node registered with one relay and moves frames both ways."""

    def __init__(
        self,
        identity: NodeIdentity,
        relay_endpoint: Endpoint,
        *,
        mesh_id: str,
        proof_for: Callable[[bytes], membership.MembershipProof | None],
        callbacks: RelayCallbacks,
        settings: RelayClientConfig | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.identity = identity
        # Where the relay is dialed now; see consider_address for the others.
        self.endpoint_info = relay_endpoint
        self._addresses = [relay_endpoint.address]
        self.mesh_id = mesh_id
        self.settings = settings or RelayClientConfig()
        self.quic_config = dataclasses.replace(self.settings.quic, alpn=p.RELAY_ALPN)
        self._proof_for = proof_for
        self._callbacks = callbacks
        self._backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max, rng)
        self._dialer: RelayDialer | None = None
        self._task: asyncio.Task[None] | None = None
        # Relay messages of this client's own (revocations), sent before any peer's record.
        self._own_messages: deque[bytes] = deque()
        self._outgoing = SendTurns()
        self._wake = asyncio.Event()
        self._registered = asyncio.Event()
        self.session: RelaySession | None = None
        self.epoch = 0
        self.last_error = ""
        self.registrations = 0
        self._observed_address = ""
        self._closed = False
        # The relay check running now, and the registration it is making to replace a silent
        # connection (see confirm_alive).
        self._check: asyncio.Task[RelayCheck] | None = None
        self._replacing: asyncio.Task[RelaySession | None] | None = None
        # Told a revocation the relay refused us with (RelayRefusal.revocation); the node verifies it.
        self.on_revocation: Callable[[membership.Revocation], None] | None = None

    @property
    def relay_id(self) -> bytes:
        return self.endpoint_info.id

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def consider_address(self, address: str) -> None:
        """Another address peers announce for this relay (it may have moved).

        While the current address does not answer, the next one is dialed, in turn; the
        first address given stays among them, and at most ``MAX_RELAY_ADDRESSES`` are kept:
        a member may announce any address, and the relay's key is checked at each.
        """
        if address in self._addresses:
            return
        self._addresses.append(address)
        if len(self._addresses) > MAX_RELAY_ADDRESSES:
            del self._addresses[1]  # the oldest announced one

    @property
    def registered(self) -> bool:
        return self.session is not None and not self.session.is_closed

    @property
    def observed_address(self) -> str:
        """Where the relay last saw this node's connection come from ("": never registered). Kept
        while the registration is down: the NAT's mapping outlives one connection."""
        return self._observed_address

    @property
    def shares_node_socket(self) -> bool:
        """Whether registrations leave from the node's mesh socket (what the relay observes is
        then where peers can punch to)."""
        return self._dialer is not None and not self._dialer.owns_endpoint

    async def start(self, local_host: str = "0.0.0.0", node_endpoint: QuicEndpoint | None = None) -> None:
        """Start registering: from ``node_endpoint``, the node's own socket, where given and able to
        reach the relay's address (else from a socket of its own, bound to ``local_host``)."""
        if node_endpoint is not None and node_endpoint.can_dial(self.endpoint_info.address):
            self._dialer = RelayDialer.shared(node_endpoint, self.quic_config)
        else:
            self._dialer = await RelayDialer.open(self.identity, self.quic_config, local_host)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_registered(self, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            await self._registered.wait()

    def send(self, destination: bytes, channel: int, payload: bytes, seal: Sealer | None = None) -> None:
        """Queue one record for ``destination`` (bounded by the senders' own flow control); with
        ``seal``, it is sealed when it leaves (see :mod:`meshnode.relaylink.send_turns`)."""
        if not self.registered:
            raise RelayUnavailable(f"not registered with relay {self.endpoint_info}")
        self._outgoing.push(destination, OutgoingRecord(channel, payload, seal))
        self._wake.set()

    def send_revocations(self, revocations: list[membership.Revocation]) -> None:
        """Hand the relay the revocations we know (it ends and refuses the registrations they name)."""
        if not self.registered or not revocations:
            return
        self._own_messages.extend(p.encode_revocations(revocations))
        self._wake.set()

    async def confirm_alive(self, timeout: float) -> RelayCheck:
        """Whether this relay answers on our connection, or on a new one within ``timeout``.

        A relay that restarted, or died without closing, leaves our connection looking alive
        until its idle timeout (15 s): it answers a PING with nothing. A connection that leaves
        a PING unanswered for half of ``timeout`` gets a new connection registered beside it
        (:meth:`_register_replacement`). Checks asked for while one runs share it.
        """
        if self._check is None or self._check.done():
            self._check = asyncio.get_running_loop().create_task(self._confirm_alive(timeout))
        check = self._check
        try:
            # Shielded: a caller that stops waiting must not end the check the others wait on.
            return await asyncio.shield(check)
        except asyncio.CancelledError:
            if check.cancelled() and self._closed and not _being_cancelled():
                return RelayCheck.AWAY  # the client closed under the check
            raise

    async def _confirm_alive(self, timeout: float) -> RelayCheck:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        session = self.session
        if session is not None and not session.is_closed:
            pinged_at = loop.time()
            session.link.ping()
            while loop.time() - pinged_at < timeout / 2:
                if session.link.last_received_at > pinged_at:
                    return RelayCheck.ANSWERED
                if session.is_closed:
                    break
                await asyncio.sleep(0.02)
            if not session.is_closed:
                log.info(
                    "relay %s left a ping unanswered for %.1f s; registering on a new connection "
                    "(the old one serves until then)",
                    self.endpoint_info,
                    timeout / 2,
                )
                self._callbacks.silent(self, "the relay left a ping unanswered")
                if self._replacing is None or self._replacing.done():
                    self._replacing = loop.create_task(self._register_replacement(session, pinged_at))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        if await asyncio.shield(self._replacing) is None and not session.is_closed:
                            return RelayCheck.ANSWERED
        while loop.time() < deadline:
            if self.registered and self.session is not session:
                return RelayCheck.REGISTERED_AGAIN
            await asyncio.sleep(0.05)
        return RelayCheck.AWAY

    async def _register_replacement(self, session: RelaySession, pinged_at: float) -> RelaySession | None:
        """A new registration to take over from ``session``, silent since ``pinged_at``.

        Made before the old connection is closed, so that a relay that is alive, only slow to
        answer (a lossy or congested path), never sees this node unregistered: the new
        registration replaces the old at the relay, and peers are told nothing. It is given up
        unsent if the old connection answers first. ``None``: not needed, or it failed (then
        the old connection, still silent, is closed and the registration loop takes over).
        """
        assert self._dialer is not None

        def silent() -> bool:
            return session.link.last_received_at <= pinged_at

        try:
            replacement = await self._dialer.register(
                self.endpoint_info,
                mesh_id=self.mesh_id,
                proof=self._proof_for(self.relay_id),
                connect_timeout=self.settings.connect_timeout,
                register_timeout=self.settings.register_timeout,
                still_needed=silent,
            )
        except RegistrationNotNeeded:
            log.info("relay %s answered on the old connection after all; keeping it", self.endpoint_info)
            return None
        except (DialError, RelayRefused, StreamError, FramingError) as exc:
            if isinstance(exc, RelayRefused):
                self._pass_revocation(exc)
            if silent():
                session.close(f"the relay left a ping unanswered and a new connection failed: {exc}")
            return None
        if self._closed:
            replacement.close()
            return None
        # The relay has moved our registration (and what it queued for us) to the new connection.
        session.close("replaced by a new registration")
        return replacement

    async def close(self) -> None:
        self._closed = True
        try:
            for task in (self._task, self._replacing, self._check):
                if task is not None:
                    await cancel_and_wait(task)
        finally:  # closed even when our caller is cancelled meanwhile
            if self.session is not None:
                self.session.close()
            replacing = self._replacing
            if replacing is not None and replacing.done() and not replacing.cancelled():
                replacement = replacing.result()
                if replacement is not None:
                    replacement.close()
            if self._dialer is not None:
                self._dialer.close()
        await asyncio.sleep(0)

    # -- the registration loop --------------------------------------------------------------

    async def _run(self) -> None:
        while not self._closed:
            session = await self._replacement() or await self._register()
            if session is None:
                continue
            self._backoff.reset()
            self.session = session
            self.epoch += 1
            self.registrations += 1
            self._registered.set()
            log.info(
                "registered with relay %s as %s%s",
                self.endpoint_info,
                short_id(self.identity.node_id),
                f"; it sees us at {session.observed_address}" if session.observed_address else "",
            )
            self._callbacks.up(self)
            self._observe(session.observed_address)
            reason = await self._pump(session)
            self.session = None
            self._registered.clear()
            self._outgoing.clear()
            self._own_messages.clear()
            self.last_error = reason
            log.info("relay %s connection lost: %s", self.endpoint_info, reason)
            self._callbacks.down(self, reason)
            if not self._closed and self._replacing is None:
                await asyncio.sleep(self._backoff.next())

    async def _replacement(self) -> RelaySession | None:
        """The registration a relay check made to replace the connection just lost, if any."""
        replacing, self._replacing = self._replacing, None
        if replacing is None:
            return None
        replacement = await asyncio.shield(replacing)
        return replacement if replacement is not None and not replacement.is_closed else None

    async def _register(self) -> RelaySession | None:
        """A new registration; ``None`` after a failure, its backoff waited."""
        assert self._dialer is not None
        try:
            return await self._dialer.register(
                self.endpoint_info,
                mesh_id=self.mesh_id,
                proof=self._proof_for(self.relay_id),
                connect_timeout=self.settings.connect_timeout,
                register_timeout=self.settings.register_timeout,
            )
        except (DialError, RelayRefused, StreamError, FramingError) as exc:
            if isinstance(exc, RelayRefused):
                self._pass_revocation(exc)
            delay = self._backoff.next()
            why = registration_failure(exc, self.mesh_id)
            if isinstance(exc, DialError):  # not reached there: try its next address
                self._next_address()
            # Say it once per distinct reason; a relay that stays down must not flood the log.
            level = logging.DEBUG if why == self.last_error else logging.WARNING
            self.last_error = why
            log.log(level, "relay %s: %s; retrying in %.1f s", self.endpoint_info, why, delay)
            await asyncio.sleep(delay)
            return None

    def _next_address(self) -> None:
        current = self.endpoint_info.address
        at = self._addresses.index(current) if current in self._addresses else -1
        following = self._addresses[(at + 1) % len(self._addresses)]
        if following != current:
            log.debug("relay %s: trying its address %s next", self.endpoint_info, following)
            self.endpoint_info = Endpoint(id=self.relay_id, address=following)

    async def _pump(self, session: RelaySession) -> str:
        writer = asyncio.get_running_loop().create_task(self._write_loop(session))
        try:
            return await self._read_loop(session)
        finally:
            try:
                await cancel_and_wait(writer, quiet=(StreamError,))
            finally:
                session.close()

    async def _read_loop(self, session: RelaySession) -> str:
        callbacks = self._callbacks
        try:
            while True:
                message = await session.recv()
                if message is None:
                    return "relay ended the stream"
                kind = message.WhichOneof("kind")
                if kind == "deliver":
                    deliver = message.deliver
                    callbacks.deliver(self, bytes(deliver.source_id), deliver.channel, deliver.payload)
                elif kind == "peer_gone":
                    callbacks.peer_gone(self, bytes(message.peer_gone.peer_id), message.peer_gone.reason)
                elif kind == "send_refused":
                    callbacks.send_refused(self, message.send_refused)
                elif kind == "observed":
                    address = message.observed.observed_address
                    if address and address != session.observed_address:
                        log.info("relay %s now sees us at %s", self.endpoint_info, address)
                        session.observed_address = address
                        self._observe(address)
                elif kind == "refused":
                    refused = RelayRefused.from_pb(message.refused)
                    self._pass_revocation(refused)
                    return str(refused)
        except LinkClosed as exc:
            return exc.reason
        except (StreamError, FramingError, RelayRefused) as exc:
            return str(exc)

    def _observe(self, address: str) -> None:
        if address and address != self._observed_address:
            self._observed_address = address
            self._callbacks.observed(self, address)

    def _pass_revocation(self, refused: RelayRefused) -> None:
        if refused.revocation is not None and self.on_revocation is not None:
            self.on_revocation(refused.revocation)

    async def _write_loop(self, session: RelaySession) -> None:
        own, outgoing = self._own_messages, self._outgoing
        while True:
            while not own and not outgoing:
                self._wake.clear()
                await self._wake.wait()
            if own:
                await session.send_body(own.popleft())
                continue
            next_record = outgoing.pop()
            assert next_record is not None
            destination, record = next_record
            payload = record.payload()
            if payload is not None:
                await session.send_body(p.encode_send(destination, record.channel, payload))


__all__ = [
    "Backoff",
    "RegistrationNotNeeded",
    "RelayCallbacks",
    "RelayCheck",
    "RelayClient",
    "RelayClientConfig",
    "RelayDialer",
    "RelaySession",
    "RelayStreamWaiter",
    "RelayUnavailable",
    "connect_and_register",
]
