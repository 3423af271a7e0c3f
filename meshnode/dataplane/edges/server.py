"""The worker's asyncio edge: serve :class:`~meshnode.dataplane.worker.ShardWorker` on real streams.

:class:`ShardServer` registers a handler per stream type with a node's
dispatcher (admitted peers only): ``SHARD_SESSION`` streams carry sessions, and
``SHARD_CAPABILITY``/``SHARD_HEALTH``/``SHARD_RELEASE``/``SHARD_CANCEL`` are one
request and one response on a fresh stream each. It depends only on
:class:`~meshnode.transport.framed.FramedStream` and
:class:`~meshnode.transport.base.PeerLink`, so QUIC streams and relay channels
are served alike.

It only carries out the worker's actions:

- ``Send``/``CloseStream`` go to the stream's outbox, written in order by one
  writer task per stream (several frames coalesce into one write);
- ``RunBatch``/``ReleaseEngine`` run on the engine's single FIFO thread, and the
  batch's outcomes come back to the worker on the loop; ``FireCancel`` fires at once;
- ``Forward`` goes through one :class:`~meshnode.dataplane.edges.shard_session.ShardSession`
  per route session toward the next hop (a link from ``links(node_id)``), and
  its outcome is reported exactly once; ``CancelDownstream``/``ReleaseDownstream``
  pass on out of band;
- the worker's actions are taken (``take_events``) and its timer re-armed after
  every call.

Leases (:mod:`.lease`): each session stream is registered with its origin —
the authenticated peer, and whether it is this node's own head
(``local_peer_id``) — and a stream that ends because its link closed (a read
raising ``LinkClosed``: the peer vanished and the transport's idle timeout ran
out, or the link was closed) is reported as such: the sessions its peer no
longer reaches end after the worker's owner grace. :meth:`ShardServer.peer_departed`
is the hook for membership: call it when a peer is confirmed down or leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from engines.interface import CancelToken, EngineHealth, SessionKey, ShardEngine
from meshnode.dataplane import errors
from meshnode.dataplane.actions import (
    Action,
    CancelDownstream,
    CloseStream,
    FireCancel,
    Forward,
    ReleaseDownstream,
    ReleaseEngine,
    RunBatch,
    Send,
)
from meshnode.dataplane.client import ClientConfig
from meshnode.dataplane.edges.engine_thread import EngineThread
from meshnode.dataplane.edges.shard_session import (
    SessionConfig,
    ShardSession,
    StepOutput,
    default_client_config,
)
from meshnode.dataplane.edges.wake_timer import WakeTimer
from meshnode.dataplane.failure_log import log_engine_failures
from meshnode.dataplane.hop_rules import NO_RULES, HopRules
from meshnode.dataplane.lease import StreamOrigin
from meshnode.dataplane.unary import (
    Validation,
    capability_report,
    handle_cancel,
    handle_release,
    health_report,
    parse_unary_request,
    validate_engine,
)
from meshnode.dataplane.worker import DownstreamResult, ShardWorker, WorkerConfig, WorkerLoad
from meshnode.identity import NodeIdentity
from meshnode.mesh.dispatcher import StreamHandler
from meshnode.transport.base import RESET_CANCELLED, LinkClosed, PeerLink, StreamError
from meshnode.transport.framed import FramedStream
from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.framing import StreamType, encode_frame
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh, shard

log = logging.getLogger(__name__)

PeerLinks = Callable[[bytes], Awaitable[PeerLink]]
Register = Callable[[StreamType, StreamHandler], None]

UNARY_STREAM_TYPES = (
    StreamType.SHARD_CAPABILITY,
    StreamType.SHARD_HEALTH,
    StreamType.SHARD_RELEASE,
    StreamType.SHARD_CANCEL,
)


@dataclass(frozen=True)
class ServerConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    # Wait for a unary request frame.
    unary_timeout_s: float = 5.0
    # After a terminal status, how long the peer may take to finish its side before a reset.
    close_grace_s: float = 2.0
    # Sessions toward next hops.
    downstream: ClientConfig = field(default_factory=default_client_config)
    downstream_options: SessionConfig = field(default_factory=SessionConfig)


class _Outbox:
    """Frames for one session stream, written in order by one task."""

    def __init__(self, framed: FramedStream) -> None:
        self.framed = framed
        self.frames: list[bytes] = []
        self.closing = False
        self._wake: asyncio.Future[None] | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    def send(self, response: shard.SessionResponse) -> None:
        self.frames.append(encode_frame(response.SerializeToString()))
        self._notify()

    def close_after_sending(self) -> None:
        self.closing = True
        self._notify()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _run(self) -> None:
        stream = self.framed.stream
        try:
            while True:
                if self.frames:
                    data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
                    self.frames.clear()
                    await stream.write(data)
                    continue
                if self.closing:
                    self.framed.finish()
                    return
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                self._wake = None
        except (StreamError, MeshnodeError):
            # The stream is gone; the reader sees it too and tells the worker.
            self.frames.clear()


class ShardServer:
    """Serves one loaded engine. ``links(node_id)`` gives a link to a next hop (``Node.get_link``)."""

    def __init__(
        self,
        engine: ShardEngine,
        *,
        links: PeerLinks,
        config: ServerConfig | None = None,
        owns_engine: bool = False,
        local_peer_id: bytes | None = None,
        identity: NodeIdentity | None = None,
        rules: HopRules = NO_RULES,
    ) -> None:
        """``local_peer_id``: this node's id; its streams (its own head's) are exempt from the
        per-peer share of sessions. ``identity``: the node key that signs the units' commitments
        (meshnode.audit; None: none are signed). ``rules``: what the admin's mesh policy asks of
        this hop (meshnode.dataplane.hop_rules)."""
        self._identity = identity
        self._rules = rules
        self.engine = engine
        self.local_peer_id = local_peer_id
        self.config = config or ServerConfig()
        self._links = links
        self._owns_engine = owns_engine
        self._loop = asyncio.get_running_loop()
        self.engine_thread = EngineThread()
        self._worker: ShardWorker | None = None
        self.validation: Validation | None = None
        self._outboxes: dict[int, _Outbox] = {}
        self._downstream: dict[SessionKey, ShardSession] = {}
        self._background: set[asyncio.Task[object]] = set()
        # The cancel tokens of the batch on the engine (by batch id), fired when the server closes.
        self._running_tokens: dict[int, list[CancelToken | None]] = {}
        self._timer = WakeTimer(self._on_timer)
        self._closing = False
        # ShardStatus refusals sent, by ErrorCode value (for /metrics).
        self.errors_sent: Counter[int] = Counter()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Validation:
        """Validate the loaded engine with a bounded real forward (on the engine thread) and build the
        worker. Serving without a passed validation is allowed; capability reports say so."""
        capabilities = await self.engine_thread.call(self.engine.capabilities)
        self.validation = await self.engine_thread.call(
            partial(validate_engine, self.engine, unix_now_ns=time.time_ns())
        )
        self._worker = ShardWorker(
            capabilities, self.config.worker, identity=self._identity, rules=self._rules
        )
        if self.validation.validated:
            # The validation's steps are the range's first timing on these threads: the speed
            # announced before any traffic, until live batches replace it.
            self._worker.batch_stats.speed.calibrate(
                decode_ns_per_token=self.validation.decode_ns,
                prefill_ns_per_token=self.validation.prefill_ns_per_token,
            )
        self._arm_timer()
        return self.validation

    def register(self, register: Register) -> None:
        """Register the session and unary handlers (e.g. ``node.register_handler``)."""
        register(StreamType.SHARD_SESSION, self.serve_session)
        for stream_type in UNARY_STREAM_TYPES:
            register(stream_type, self.serve_unary)

    @property
    def worker(self) -> ShardWorker:
        if self._worker is None:
            raise RuntimeError("the shard server is not started")
        return self._worker

    def load(self) -> WorkerLoad:
        return self.worker.load()

    async def engine_health(self) -> EngineHealth:
        try:
            return await self.engine_thread.call(self.engine.health)
        except Exception:
            return EngineHealth(False, 0, 0, 0, 0, detail="engine health is unavailable")

    async def health(self) -> shard.HealthReport:
        return health_report(self.worker, await self.engine_health())

    async def announced_load(self) -> mesh.Load:
        """What the node gossips about this worker's load."""
        load = self.worker.load()
        health = await self.engine_health()
        # The worker keeps its serving state as a plain int; the protobuf stubs type the field as the enum.
        serving_state = cast(shard.ServingState, load.serving_state)
        return mesh.Load(
            active_sessions=load.active_sessions,
            queued_chunks=load.queued_units,
            kv_pressure=health.kv_pressure,
            serving_state=serving_state if health.loaded else shard.SERVING_STATE_NOT_SERVING,
        )

    async def aclose(self) -> None:
        """Stop serving: abandon running work, drop next-hop sessions, end streams, stop the engine
        thread (closing the engine when the server owns it)."""
        if self._closing:
            return
        self._closing = True
        self._timer.cancel()
        if self._worker is not None:
            self._worker.set_serving_state(shard.SERVING_STATE_NOT_SERVING)
        for tokens in list(self._running_tokens.values()):
            for token in tokens:
                if token is not None:
                    token.cancel()
        for session in list(self._downstream.values()):
            session.abort()
        self._downstream.clear()
        for outbox in list(self._outboxes.values()):
            outbox.task.cancel()
            with contextlib.suppress(Exception):
                outbox.framed.reset(RESET_CANCELLED)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._owns_engine:
            with contextlib.suppress(Exception):
                self.engine_thread.submit(self.engine.close)
        await self.engine_thread.stop()

    # ------------------------------------------------------------------ session streams

    async def serve_session(self, framed: FramedStream) -> None:
        if self._closing or self._worker is None:
            raise MeshRefusal(mesh.MESH_ERROR_OVERLOADED, "the shard server is not serving")
        worker = self._worker
        stream_id = worker.open_stream(self._origin(framed))
        outbox = _Outbox(framed)
        self._outboxes[stream_id] = outbox
        clean = link_lost = False
        try:
            while not outbox.closing:
                body = await framed.recv_frame()
                if body is None:
                    break
                worker.receive_frame(stream_id, body, time.monotonic_ns(), unix_now_ns=time.time_ns())
                self._apply(worker.take_events())
            clean = True
        except LinkClosed:
            link_lost = True
            raise
        finally:
            del self._outboxes[stream_id]
            if not self._closing:
                worker.stream_closed(stream_id, time.monotonic_ns(), link_lost=link_lost)
                self._apply(worker.take_events())
            if clean:
                await self._finish(framed, outbox)
            else:
                outbox.task.cancel()

    def _origin(self, framed: FramedStream) -> StreamOrigin:
        peer_id = framed.stream.peer_id
        return StreamOrigin(peer_id, local=peer_id == self.local_peer_id)

    def peer_departed(self, peer_id: bytes) -> None:
        """Membership confirmed ``peer_id`` down, or it left: its sessions end after the owner grace."""
        if not self._closing and self._worker is not None:
            self._worker.peer_departed(peer_id, time.monotonic_ns())
            self._apply(self._worker.take_events())

    async def _finish(self, framed: FramedStream, outbox: _Outbox) -> None:
        """Write what is queued and end our side; after a terminal status, give the peer a moment to
        end its side (its frames are ignored) before resetting."""
        terminated = outbox.closing
        outbox.close_after_sending()
        try:
            async with asyncio.timeout(self.config.close_grace_s):
                await outbox.task
                if terminated:
                    while await framed.recv_frame() is not None:
                        pass
        except (TimeoutError, StreamError, MeshnodeError):
            outbox.task.cancel()
            with contextlib.suppress(Exception):
                framed.reset(RESET_CANCELLED)

    # ------------------------------------------------------------------ unary streams

    async def serve_unary(self, framed: FramedStream) -> None:
        if self._closing or self._worker is None:
            raise MeshRefusal(mesh.MESH_ERROR_OVERLOADED, "the shard server is not serving")
        body = await framed.recv_frame(self.config.unary_timeout_s)
        if body is None:
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, "the stream ended before the request")
        stream_type = framed.stream_type
        assert stream_type is not None
        try:
            request = parse_unary_request(stream_type, body)
        except ShardProtocolError as exc:
            raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, exc.detail) from None
        worker = self._worker
        now_ns = time.monotonic_ns()
        response: object
        if isinstance(request, shard.CapabilityRequest):
            response = capability_report(worker, request, self.validation)
        elif isinstance(request, shard.HealthRequest):
            response = health_report(worker, await self.engine_health())
        elif isinstance(request, shard.ReleaseRequest):
            response, actions = handle_release(worker, request, now_ns)
            self._apply(actions)
        else:
            assert isinstance(request, shard.CancelRequest)
            response, actions = handle_cancel(worker, request, now_ns)
            self._apply(actions)
        await framed.send_frame(response.SerializeToString())

    # ------------------------------------------------------------------ actions

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send():
                    response = action.response
                    if response.WhichOneof("kind") == "status":
                        self.errors_sent[response.status.error.code] += 1
                    outbox = self._outboxes.get(action.stream_id)
                    if outbox is not None:
                        outbox.send(response)
                case RunBatch():
                    self._run_batch(action)
                case FireCancel():
                    action.token.cancel()
                case ReleaseEngine():
                    self.engine_thread.submit(self.engine.release, action.session)
                case CloseStream():
                    outbox = self._outboxes.get(action.stream_id)
                    if outbox is not None:
                        outbox.close_after_sending()
                case Forward():
                    self._forward(action)
                case CancelDownstream():
                    self._cancel_downstream(action)
                case ReleaseDownstream():
                    self._release_downstream(action.session)
        self._arm_timer()

    def _run_batch(self, action: RunBatch) -> None:
        self._running_tokens[action.batch_id] = [step.request.cancel_token for step in action.steps]
        self.engine_thread.submit(
            action.execute,
            self.engine,
            on_done=partial(self._batch_done, action.batch_id, len(action.steps)),
        )

    def _batch_done(self, batch_id: int, steps: int, outcome: object) -> None:
        self._running_tokens.pop(batch_id, None)
        log_engine_failures(outcome, steps)
        if self._closing:
            return
        self.worker.batch_finished(batch_id, outcome, time.monotonic_ns())
        self._apply(self.worker.take_events())

    # ------------------------------------------------------------------ next hops

    def _next_hop(self, action: Forward) -> ShardSession:
        session = self._downstream.get(action.session)
        if session is not None and not session.closed:
            return session
        node_id = bytes(action.hop.node_id)
        session = ShardSession.create(
            lambda: self._links(node_id),
            fingerprint=self.worker.fingerprint,
            shard_range=action.hop.shard_range,
            route=action.route,
            route_session_id=action.session.session_id,
            route_epoch=action.session.epoch,
            config=self.config.downstream,
            options=self.config.downstream_options,
        )
        self._downstream[action.session] = session
        return session

    def _forward(self, action: Forward) -> None:
        try:
            handle = self._next_hop(action).submit_forward(action.work)
        except MeshnodeError as exc:
            # Reported on the next turn of the loop: the worker is not re-entered mid-action.
            self._loop.call_soon(self._forward_done, action.unit_id, exc)
            return
        handle.future.add_done_callback(partial(self._forward_settled, action.unit_id))

    def _forward_settled(self, unit_id: int, future: asyncio.Future[StepOutput]) -> None:
        if future.cancelled():
            outcome: object = errors.SessionTransportError("the next-hop session was closed")
        elif future.exception() is not None:
            outcome = future.exception()
        else:
            done = future.result().done
            outcome = DownstreamResult(
                done.bundle, answered_directly=done.answered_directly, commitments=done.commitments
            )
        self._forward_done(unit_id, outcome)

    def _forward_done(self, unit_id: int, outcome: object) -> None:
        if self._closing:
            return
        if isinstance(outcome, BaseException) and not isinstance(outcome, ShardProtocolError):
            # The upstream peer hears only "next hop unreachable"; the reason is told here.
            log.warning("could not pass a step to the next hop: %s", str(outcome) or type(outcome).__name__)
        self.worker.downstream_finished(unit_id, outcome, time.monotonic_ns())
        self._apply(self.worker.take_events())

    def _cancel_downstream(self, action: CancelDownstream) -> None:
        session = self._downstream.get(action.session)
        if session is not None and not session.closed:
            self._spawn(session.cancel(action.work_id, reason="cancelled upstream"))

    def _release_downstream(self, key: SessionKey) -> None:
        session = self._downstream.pop(key, None)
        if session is not None:
            self._spawn(session.aclose(release=True))

    def _spawn(self, coro: Awaitable[object]) -> None:
        task = self._loop.create_task(_quietly(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ time

    def _arm_timer(self) -> None:
        if self._worker is not None:
            self._timer.arm(self._worker.get_timer())

    def _on_timer(self) -> None:
        if not self._closing:
            self.worker.handle_timer(time.monotonic_ns())
            self._apply(self.worker.take_events())


async def _quietly(coro: Awaitable[object]) -> None:
    """Best-effort pass-ons to a next hop: its failure changes nothing here."""
    try:
        await coro
    except (MeshnodeError, OSError, TimeoutError) as exc:
        log.debug("next-hop signal failed: %s", exc)


__all__ = ["UNARY_STREAM_TYPES", "PeerLinks", "ServerConfig", "ShardServer"]
