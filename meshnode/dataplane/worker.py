"""The worker side of the shard session protocol, sans-IO.

One :class:`ShardWorker` per served shard holds the node-wide state: the route
sessions (by id, at their current epoch) with their idempotency ledgers, the
unit queues, the engine batch running, and the admission budgets. Streams are
registered with :meth:`ShardWorker.open_stream`; everything that happens —
a frame (``receive_frame``), an engine result, a next-hop result, time passing
(``handle_timer``), a stream closing — is one method call, and the
:mod:`~meshnode.dataplane.actions` it leads to wait for the edge to carry them
out, in order, from :meth:`ShardWorker.take_events` (the :mod:`meshnode.sansio`
convention). Time is always the ``now_ns`` argument, monotonic nanoseconds, and
leases and timers run on it alone; a frame also comes with ``unix_now_ns``, the
wall-clock time its envelope deadline (``deadline_unix_nanos``) is read against,
once, on arrival. Nothing here reads a clock or does I/O.

Stream lifecycle: the opener's first frame is a ``SessionRoute``, the second a
``SessionOpen``; the worker answers ``SessionAccepted`` or a terminal
``ShardStatus``. Then each ``ActivationChunk``/``DecodeStep`` is one unit that
takes one credit and is answered exactly once: an optional result ``chunk``
then an ``Ack``, or a ``ShardStatus``. Both return the credit.

Direct answer: a head may open an *answer stream* to the tail (its ``SessionOpen`` sets
``answer_stream``; an empty route goes first, as on every stream). It holds no session and
no credit; the tail sends on it the result chunk of every unit it samples a token for in
that session and epoch, and the unit's own stream gets only the Ack, marked
``answered_directly``, which every hop passes on in its own Ack
(:class:`DownstreamResult`). Without an open answer stream for the epoch (not yet opened,
closed) the tail answers along the route. A replayed step is answered the same way.

Batching (continuous, per shard): whenever the engine is free, the head units of the
sessions with work queued form one engine batch — every ready decode that fits plus at
most one bounded prefill chunk, at most one unit per session, in the fair order of
:mod:`.batching` (round robin across owners, then sessions) — emitted as one
:class:`~meshnode.dataplane.actions.RunBatch` and reported with
:meth:`ShardWorker.batch_finished`. A unit that arrives while a batch runs waits for the
next one, formed as soon as this one's results are answered or forwarded (never waiting
on the next hop). Every per-unit rule holds inside a batch: each unit is checked
(deadline, replay, cache) as it leaves its queue and takes no room when refused, has its
own cancel token (a cancel or deadline fires that unit's only), and gets its own outcome;
an exception failing the whole batch fails each unit as it would have failed it alone.
When the sessions' routes ask for a pipeline (``SessionRoute.pipeline_stages``), a batch
takes at most one cohort of them (:mod:`.cohorts`), so the route's stages compute
different cohorts at once instead of passing one convoy along.
:attr:`ShardWorker.batch_stats` counts sizes, queue waits and busy time for ``/metrics``.

Choices the schema leaves open, made here:

- Work before the open has no credit → FLOW_CONTROL_VIOLATION (terminal); any
  other message out of place, or bytes that do not parse → PAYLOAD_CORRUPT
  (terminal). A ``FlowControl`` request is accepted and has no effect: at most
  one result chunk answers each unit, so results are bounded by the units'
  own credit.
- Every flow-control violation (too many un-acked units, a chunk over
  ``max_chunk_bytes`` or ``max_prefill_chunk_tokens``) is terminal.
- An envelope naming another session than the stream's → PAYLOAD_CORRUPT.
- Idempotency rules (gaps → CACHE_MISS) are explained in :mod:`.steps`.
- Context budget: a unit reaching past ``max_context_tokens`` of one session is
  RESOURCE_EXHAUSTED with ``retryable = false`` (it can never fit unchanged);
  the node-wide budgets (sessions, total context tokens, queue depth, draining)
  are ``retryable = true``.
- The tail samples with ``sample_index`` = the position of the token being
  sampled, so a retry or a re-prefill replay draws the same token.
- Speculative decoding (meshnode extension): a verify step is a PHASE_DECODE unit of
  1 + ``draft_tokens`` positions. It is filed and run like a prefill chunk, alone (the
  engine computes each position exactly as its decode would, engines.row_invariance, so the
  text is plain greedy decoding's), every hop remembers its drafts as uncommitted, and
  the tail answers the choice after every position. The next unit of the session may carry
  ``CacheExpectation.rollback``: the cache check then admits a held length between the
  committed one and the held one (engines.interface.rollback_refusal; CACHE_MISS
  otherwise, as without it), and the engine drops the rejected drafts before running.
  A retried verify step is replayed from its record like any other: never re-applied.
- Cache mode STATELESS is run as a fresh prefill at position 0 (the state it
  leaves is released like any other).
- Leases (:mod:`.lease`): a session belongs to the peer whose stream opened it.
  When the owner seems gone — membership dropped it (:meth:`ShardWorker.peer_departed`),
  or a stream ended because its link was lost (``stream_closed(link_lost=True)``;
  then only the sessions no other stream of the owner serves) — the session
  ends ``owner_grace_ns`` later, unless a frame or a stream from the owner for
  it arrives first: a re-dial, a duplicate link closed by the tie-break, or a
  relay restart that a probe mistook for a death must not cost a session its
  cache. An idle session ends when its lease (refreshed by every frame for it,
  sized by the last unit's deadline) runs out. A peer over its share of the
  sessions is refused at admission with RESOURCE_EXHAUSTED, ``retryable = true``
  (its own sessions ending frees room); this node's own streams have no share.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace

from google.protobuf.message import DecodeError

from engines.interface import (
    BatchStep,
    CancelToken,
    EngineCapabilities,
    EngineError,
    StepRequest,
    StepResult,
    rollback_refusal,
)
from meshnode.dataplane import errors, responses
from meshnode.dataplane.actions import (
    Action,
    CancelDownstream,
    CloseStream,
    FireCancel,
    Forward,
    ForwardWork,
    ReleaseDownstream,
    ReleaseEngine,
    RunBatch,
    Send,
)
from meshnode.dataplane.admission import AdmissionPolicy
from meshnode.dataplane.arrival_forecast import ArrivalForecast
from meshnode.dataplane.batch_stats import BatchStats
from meshnode.dataplane.batching import BatchLimits, BatchScheduler
from meshnode.dataplane.cohorts import cohort_limit
from meshnode.dataplane.envelope import (
    HIGHEST_SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    Deadline,
    UnitPosition,
    digests,
    range_tuple,
    unit_position,
)
from meshnode.dataplane.lease import (
    LOCAL_ORIGIN,
    ReleaseReason,
    StreamOrigin,
    idle_timeout_ns,
    peer_session_cap,
)
from meshnode.dataplane.payload import (
    HopRole,
    StepInput,
    check_result,
    decode_chunk_input,
    decode_step_input,
    encode_hidden,
    encode_token_result,
    encode_verify_result,
)
from meshnode.dataplane.route import RoutePlan, validate_route
from meshnode.dataplane.steps import RecordState, StepLedger, StepRecord, Verdict
from meshnode.dataplane.worker_state import RunningBatch, SessionState, StreamPhase, StreamState, Unit
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.bundle_reader import read_activation_chunk
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.flow_control import default_flow_control, negotiate_flow_control
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import encode_bundle
from meshnode.wire.tensor_parts import DEFAULT_LIMITS, BundleParts, bundle_parts_from_pb

# Epochs of sessions dropped recently, so a late stream cannot resurrect an old epoch.
RETIRED_EPOCHS_KEPT = 1024


@dataclass(frozen=True)
class WorkerConfig:
    # None: the engine's own session limit.
    max_sessions: int | None = None
    # Units waiting for the engine, over all sessions.
    max_queue_depth: int = 64
    # Sum over sessions of the positions they hold or have queued; None: no node-wide cap.
    max_total_context_tokens: int | None = None
    # Local flow-control limits; None: meshnode.wire.flow_control.default_flow_control().
    flow_control: shard.FlowControl | None = None
    # Compressions this worker decodes (NONE is always included).
    accepted_compression: tuple[int, ...] = (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD)
    # Recently applied steps remembered per session for duplicate replies.
    replay_window: int = 16
    # A session with no unit in flight is dropped after this long without a frame for it; a
    # unit's envelope deadline shortens it (to no less than the floor), never lengthens it.
    session_idle_ttl_ns: int = 120 * 1_000_000_000
    session_idle_floor_ns: int = 5 * 1_000_000_000
    # Sessions one peer other than this node may hold: ceil(share × max_sessions). 1.0: no limit
    # beyond max_sessions (the node's service sets its own default).
    peer_session_share: float = 1.0
    # When a session's owner seems gone, how long the session waits for it to show up again.
    owner_grace_ns: int = 5 * 1_000_000_000
    max_session_id_length: int = 128
    # What one engine batch may carry (meshnode.dataplane.batching); None: every session's decode
    # plus one prefill chunk of the largest size flow control admits.
    batch_limits: BatchLimits | None = None
    # The longest the free engine waits for sessions due back (meshnode.dataplane.arrival_forecast),
    # as a share of the last batch's time and at most max_batch_hold_ns; 0 turns waiting off.
    batch_hold_share: float = 1.0
    max_batch_hold_ns: int = 50_000_000


@dataclass(frozen=True)
class DownstreamResult:
    """What the next hop returned for a forwarded unit: its result tensors, if any, or word that the
    tail sent the result to the session's head directly (``answered_directly``)."""

    bundle: shard.TensorBundle | None = None
    answered_directly: bool = False


@dataclass(frozen=True)
class WorkerLoad:
    active_sessions: int
    queued_units: int
    running_units: int
    serving_state: int


class ShardWorker:
    """Node-wide session protocol state for one served shard. See the module docstring."""

    def __init__(self, capabilities: EngineCapabilities, config: WorkerConfig | None = None) -> None:
        self.capabilities = capabilities
        self.config = config or WorkerConfig()
        self.local_flow_control = self.config.flow_control or default_flow_control()
        self.accepted_compression = tuple(sorted({shard.COMPRESSION_NONE, *self.config.accepted_compression}))
        max_sessions = (
            self.config.max_sessions if self.config.max_sessions is not None else capabilities.max_sessions
        )
        # What the worker admits: its limits live here alone (max_sessions reads them).
        self.admission = AdmissionPolicy(
            max_sessions=max_sessions,
            peer_session_cap=peer_session_cap(self.config.peer_session_share, max_sessions),
            max_context_tokens=capabilities.max_context_tokens,
            max_total_context_tokens=self.config.max_total_context_tokens,
            max_queue_depth=self.config.max_queue_depth,
        )
        self.serving_state: int = shard.SERVING_STATE_SERVING
        # Sessions ended, by why (for /metrics); opens refused for a peer over its share.
        self.releases: Counter[ReleaseReason] = Counter()
        self.share_refusals = 0
        # Results sent straight to a session's head on its answer stream (direct answer).
        self.direct_answers = 0
        fp = capabilities.fingerprint
        self.fingerprint = shard.Fingerprint(
            model_artifact_digest=fp.model_artifact_digest,
            runtime_recipe_digest=fp.runtime_recipe_digest,
            recipe_id=fp.recipe_id,
            recipe_version=fp.recipe_version,
            catalogue_version=fp.catalogue_version,
        )
        self._digests = digests(self.fingerprint)
        self._streams: dict[int, StreamState] = {}
        self._sessions: dict[str, SessionState] = {}
        self._retired_epochs: OrderedDict[str, int] = OrderedDict()
        # Sessions with queued units; the scheduler holds their turns.
        self._ready: dict[str, SessionState] = {}
        self.batch_limits = self.config.batch_limits or BatchLimits(
            max_units=max(1, self.max_sessions),
            max_tokens=max(1, self.max_sessions) + self.local_flow_control.max_prefill_chunk_tokens,
        )
        self._scheduler = BatchScheduler(self.batch_limits)
        self.batch_stats = BatchStats()
        self._forecast = ArrivalForecast()
        # While the free engine waits for sessions due back: until when (monotonic ns).
        self._hold_until_ns: int | None = None
        self._last_batch_ns = 0
        self._queued = 0
        # The batch the engine is computing; one at a time, since each session's next unit
        # continues the cache its unit in this batch leaves.
        self._running: RunningBatch | None = None
        self._next_batch_id = 1
        self._forwarding: dict[int, Unit] = {}
        self._followers: dict[int, Unit] = {}
        self._next_stream_id = 1
        self._next_unit_id = 1
        # Direct answer: the answer stream a head opened for (session id, epoch), newest kept.
        self._answer_streams: dict[tuple[str, int], int] = {}
        # What the edge is to carry out, in order, until it calls take_events().
        self._events: list[Action] = []

    # ------------------------------------------------------------------ public API

    @property
    def max_sessions(self) -> int:
        """Sessions this worker holds at once (its admission policy's)."""
        return self.admission.max_sessions

    def set_serving_state(self, state: int) -> None:
        """SERVING accepts new sessions; DRAINING and NOT_SERVING refuse them, existing ones continue."""
        self.serving_state = state

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            active_sessions=len(self._sessions),
            queued_units=self._queued,
            running_units=len(self._running.units) if self._running is not None else 0,
            serving_state=self.serving_state,
        )

    def take_events(self) -> list[Action]:
        """The actions every call since the last one produced, in order, for the edge to carry out."""
        events, self._events = self._events, []
        return events

    def open_stream(self, origin: StreamOrigin = LOCAL_ORIGIN) -> int:
        """Register an accepted SHARD_SESSION stream (or relay channel) from ``origin``; returns its id."""
        stream_id = self._next_stream_id
        self._next_stream_id += 1
        self._streams[stream_id] = StreamState(stream_id, origin)
        return stream_id

    def peer_departed(self, peer_id: bytes, now_ns: int) -> None:
        """Membership confirmed ``peer_id`` down, or it left: the sessions it opened end
        ``owner_grace_ns`` from now unless it shows up for them again."""
        for session in self._sessions.values():
            if not session.owner.local and session.owner.peer_id == peer_id:
                self._orphan(session, now_ns, ReleaseReason.OWNER_DEPARTED)
        self.handle_timer(now_ns)  # with no grace they end now; otherwise the timer ends them

    def owners(self) -> set[bytes]:
        """The peers (other than this node) that hold sessions here."""
        return {s.owner.peer_id for s in self._sessions.values() if not s.owner.local}

    def sessions_of(self, peer_id: bytes) -> int:
        """Sessions that ``peer_id`` holds here as a peer (its share's measure)."""
        return sum(1 for s in self._sessions.values() if not s.owner.local and s.owner.peer_id == peer_id)

    def receive_frame(self, stream_id: int, body: bytes, now_ns: int, *, unix_now_ns: int) -> None:
        """One frame body from the stream: the route first, then SessionRequests. A unit's
        deadline is read against ``unix_now_ns``, the wall clock at ``now_ns``."""
        stream = self._streams[stream_id]
        out = self._events
        if stream.phase is StreamPhase.CLOSED:
            return
        awaiting_route = stream.phase is StreamPhase.AWAIT_ROUTE
        message = dataplane.SessionRoute() if awaiting_route else shard.SessionRequest()
        # An activation chunk's tensors are read in place (no copy of the payload);
        # any other message, or an unusual encoding of one, goes through protobuf.
        lifted = None if awaiting_route else read_activation_chunk(body, DEFAULT_LIMITS)
        try:
            if lifted is None:
                message.ParseFromString(body)
            else:
                envelope = message.chunk.envelope
                envelope.SetInParent()
                envelope.ParseFromString(lifted[0])
        except DecodeError:
            self._terminate(out, stream, errors.payload_corrupt("frame is not a well-formed message"))
            return
        if isinstance(message, dataplane.SessionRoute):
            self._on_route(out, stream, message)
        else:
            bundle = None if lifted is None else lifted[1]
            self._on_request(out, stream, message, bundle, len(body), now_ns, unix_now_ns)

    def stream_closed(self, stream_id: int, now_ns: int, *, link_lost: bool = False) -> None:
        """The transport finished or lost the stream. Its queued units are dropped (never applied);
        a running or forwarding unit completes and is recorded for a retry on another stream.

        ``link_lost``: the stream ended because its link closed. The sessions of that stream's
        peer that no other open stream of the peer serves then end ``owner_grace_ns`` from now
        (their KV freed) unless the peer shows up for them again."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._drop_stream(stream)
            del self._streams[stream_id]
            if link_lost:
                self._orphan_unserved(stream.origin, now_ns)
        self._pump(self._events, now_ns)
        if link_lost:
            self.handle_timer(now_ns)  # with no grace they end now; otherwise the timer ends them

    def batch_finished(self, batch_id: int, outcomes: object, now_ns: int) -> None:
        """Report a RunBatch: ``outcomes`` is the list the engine returned (a StepResult or an
        EngineError per unit, in the batch's order), or the exception that failed the whole
        batch, which then fails each of its units as that exception would have failed it alone."""
        batch = self._running
        if batch is None or batch.id != batch_id:
            raise KeyError(f"batch {batch_id} is not running")
        self._running = None
        if self.batch_stats.running_since_ns is not None:
            self._last_batch_ns = max(0, now_ns - self.batch_stats.running_since_ns)
        self.batch_stats.finished(now_ns)
        out = self._events
        per_unit: list[object]
        if isinstance(outcomes, BaseException):
            per_unit = [outcomes] * len(batch.units)
        elif isinstance(outcomes, list | tuple) and len(outcomes) == len(batch.units):
            per_unit = list(outcomes)
        else:
            # An engine that broke the one-outcome-per-step contract: nothing in it can be trusted.
            count = len(outcomes) if isinstance(outcomes, list | tuple) else type(outcomes).__name__
            failure = RuntimeError(f"engine returned {count} outcomes for {len(batch.units)} steps")
            per_unit = [failure] * len(batch.units)
        for unit, outcome in zip(batch.units, per_unit, strict=True):
            self._unit_finished(out, unit, outcome, now_ns)
            session = unit.session
            if self._sessions.get(session.session_id) is session and not session.queue:
                self._forecast.answered(session.session_id, now_ns)
        # Results are answered or forwarded above; the next batch starts now, without waiting for
        # the next hop (its answers arrive through downstream_finished).
        self._pump(out, now_ns)

    def _unit_finished(self, out: list[Action], unit: Unit, outcome: object, now_ns: int) -> None:
        session = unit.session
        live = self._sessions.get(session.session_id) is session
        if live:
            session.last_active_ns = now_ns
        if isinstance(outcome, BaseException):
            error = errors.from_engine_failure(outcome)
            if live:
                is_miss = error.code == shard.ERROR_CODE_CACHE_MISS
                session.past_len = error.actual_past_len if is_miss else None
                # How much of what the engine holds is committed is not known after a refusal.
                session.committed_len = None
            self._fail(out, unit, error)
            return
        try:
            sampled = unit.position.final and session.role.is_tail
            result = check_result(
                outcome,
                session.role,
                unit.position.token_count,
                sampled=sampled,
                want_logits=session.plan.return_logits,
                verify=unit.position.verify,
            )
        except ShardProtocolError as error:
            if live:
                session.past_len = session.committed_len = None
            self._fail(out, unit, error)
        else:
            if live:
                self._applied(out, unit, result)

    def downstream_finished(self, unit_id: int, outcome: object, now_ns: int) -> None:
        """Report a Forward: a :class:`DownstreamResult`, or the error the next hop's client raised
        (``ShardProtocolError`` for a refusal, anything else for a transport failure)."""
        unit = self._forwarding.pop(unit_id)
        record = unit.record
        assert record is not None
        out = self._events
        waiting = [unit, *record.followers]
        for follower in record.followers:
            self._followers.pop(follower.id, None)
        record.followers.clear()
        if isinstance(outcome, DownstreamResult):
            record.state = RecordState.COMPLETE
            record.forward = None
            record.answered_directly = outcome.answered_directly
            if outcome.bundle is not None:
                record.result = self._result_chunk(unit, outcome.bundle)
            for waiter in waiting:
                self._succeed(out, waiter, record, duplicate=waiter.replay)
        else:
            record.state = RecordState.FORWARD_FAILED
            error = _downstream_error(outcome)
            for waiter in waiting:
                self._fail(out, waiter, error)
        unit.session.ledger.trim()
        if self._sessions.get(unit.session.session_id) is unit.session:
            unit.session.last_active_ns = now_ns
        self._pump(out, now_ns)

    def handle_timer(self, now_ns: int) -> None:
        """Expire deadlines and idle sessions at ``now_ns``."""
        out = self._events
        expired = errors.deadline_exceeded
        for running in self._running.units if self._running is not None else ():
            if not running.answered and _passed(running.deadline, now_ns):
                # Only this unit's token: the others in its batch run on.
                assert running.token is not None
                out.append(FireCancel(running.id, running.token))
                self._fail(out, running, expired())
        for session in list(self._ready.values()):
            late = [u for u in session.queue if _passed(u.deadline, now_ns)]
            if late:
                self._unqueue(session, late)
                for unit in late:
                    self._fail(out, unit, expired())
        for unit in [*self._forwarding.values(), *self._followers.values()]:
            if not unit.answered and _passed(unit.deadline, now_ns):
                self._fail(out, unit, expired())
        for follower_id in [i for i, u in self._followers.items() if u.answered]:
            del self._followers[follower_id]
        for session in list(self._sessions.values()):
            orphaned = session.orphaned_until_ns
            if orphaned is not None and orphaned <= now_ns:
                # Busy or not: whatever it is computing can no longer reach its owner.
                assert session.orphan_reason is not None
                self._end_session(out, session, session.orphan_reason)
            elif not self._busy(session) and self._lease_end(session) <= now_ns:
                self._drop_session(out, session, ReleaseReason.IDLE)
        self._pump(out, now_ns)

    def get_timer(self) -> int | None:
        """When :meth:`handle_timer` next has work to do (monotonic ns), or None."""
        times = [
            u.deadline.at_ns for u in self._units_in_flight() if u.deadline is not None and not u.answered
        ]
        times.extend(self._lease_end(s) for s in self._sessions.values() if not self._busy(s))
        times.extend(s.orphaned_until_ns for s in self._sessions.values() if s.orphaned_until_ns is not None)
        if self._hold_until_ns is not None:
            times.append(self._hold_until_ns)
        return min(times, default=None)

    def cancel(self, session_id: str, epoch: int, work_id: str, now_ns: int) -> int:
        """Abandon the session's running, queued and forwarding units (only ``work_id`` if given).

        Each gets a CANCELLED status on its stream; returns how many. Nothing at that
        epoch (unknown session, other epoch) cancels nothing.
        """
        session = self._sessions.get(session_id)
        if session is None or session.epoch != epoch:
            return 0
        out = self._events
        count = self._cancel_units(out, session, work_id, errors.cancelled("cancelled by the peer"))
        self._pump(out, now_ns)
        return count

    def release(self, session_id: str, epoch: int, now_ns: int) -> bool:
        """Drop the session's state; False (not an error) when there was none at that epoch."""
        session = self._sessions.get(session_id)
        if session is None or session.epoch != epoch:
            return False
        out = self._events
        self._cancel_units(out, session, "", errors.cancelled("session released"))
        self._drop_session(out, session, ReleaseReason.RELEASED)
        self._pump(out, now_ns)
        return True

    def session_epoch(self, session_id: str) -> int | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.epoch

    # ------------------------------------------------------------------ stream messages

    def _on_route(self, out: list[Action], stream: StreamState, route: dataplane.SessionRoute) -> None:
        caps = self.capabilities
        try:
            stream.plan = validate_route(route, end_layer=caps.layer_end, is_tail=caps.is_tail)
        except ShardProtocolError as error:
            self._terminate(out, stream, error)
            return
        stream.route_bytes = route.SerializeToString(deterministic=True)
        stream.phase = StreamPhase.AWAIT_OPEN

    def _on_request(
        self,
        out: list[Action],
        stream: StreamState,
        request: shard.SessionRequest,
        bundle: BundleParts | None,
        size: int,
        now_ns: int,
        unix_now_ns: int,
    ) -> None:
        """``bundle``: the chunk's tensors when they were read in place, else None (read them from ``request``)."""
        kind = request.WhichOneof("kind")
        if stream.answer_only and kind != "flow_control":
            # It was granted no credit, and signals belong on the session's work streams.
            self._terminate(out, stream, errors.flow_control_violation("an answer stream carries no work"))
            return
        if kind == "decode" or kind == "chunk":
            if stream.phase is not StreamPhase.OPEN:
                self._terminate(
                    out, stream, errors.flow_control_violation("work sent before the session opened")
                )
            else:
                self._on_unit(out, stream, request, bundle, kind, size, now_ns, unix_now_ns)
        elif kind == "open":
            if stream.phase is StreamPhase.OPEN:
                self._terminate(out, stream, errors.payload_corrupt("the session is already open"))
            else:
                self._on_open(out, stream, request.open, now_ns)
        elif stream.phase is not StreamPhase.OPEN:
            self._terminate(
                out, stream, errors.payload_corrupt(f"{kind or 'empty request'} before SessionOpen")
            )
        elif kind == "cancel":
            self._touch_stream_session(stream, now_ns)
            signal = request.cancel
            if self._on_signal(out, stream, signal.route_session_id, signal.work_id):
                self.cancel(stream.session_id, signal.route_epoch, signal.work_id, now_ns)
        elif kind == "release":
            if self._on_signal(out, stream, request.release.route_session_id, request.release.work_id):
                self.release(stream.session_id, request.release.route_epoch, now_ns)
        elif kind == "flow_control":
            self._touch_stream_session(stream, now_ns)
        else:
            self._terminate(out, stream, errors.payload_corrupt("empty request"))

    def _on_signal(self, out: list[Action], stream: StreamState, session_id: str, work_id: str) -> bool:
        if session_id == stream.session_id:
            return True
        self._status(out, stream, work_id, 0, errors.payload_corrupt("signal names another session"))
        return False

    def _on_open(self, out: list[Action], stream: StreamState, open_: shard.SessionOpen, now_ns: int) -> None:
        caps = self.capabilities
        if open_.schema_version == shard.SCHEMA_VERSION_UNSPECIFIED:
            self._terminate(
                out,
                stream,
                errors.refusal(shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "schema version is unspecified"),
            )
            return
        if digests(open_.fingerprint) != self._digests:
            self._terminate(
                out,
                stream,
                errors.refusal(
                    shard.ERROR_CODE_FINGERPRINT_MISMATCH, "fingerprint differs from the served one"
                ),
            )
            return
        r = open_.shard_range
        if (
            r.start_layer != caps.layer_start
            or r.end_layer != caps.layer_end
            or not r.start_layer <= r.effective_start_layer < r.end_layer
        ):
            self._terminate(
                out,
                stream,
                errors.refusal(
                    shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
                    f"this worker serves [{caps.layer_start}, {caps.layer_end}) "
                    "with an effective start inside it",
                ),
            )
            return
        session_id = open_.route_session_id
        # Control characters are refused so that no peer can name a worker-internal scratch session.
        if (
            not session_id
            or len(session_id) > self.config.max_session_id_length
            or not session_id.isprintable()
        ):
            self._terminate(
                out, stream, errors.payload_corrupt("route session id is empty, too long or not printable")
            )
            return
        if open_.answer_stream:
            self._on_answer_open(out, stream, open_)
            return
        stream.session_id = session_id
        stream.epoch = open_.route_epoch
        stream.shard_range = range_tuple(r)
        stream.schema_version = min(open_.schema_version, HIGHEST_SCHEMA_VERSION)
        try:
            session = self._session_for(out, stream, open_.route_epoch, now_ns)
        except ShardProtocolError as error:
            self._terminate(out, stream, error)
            return
        self._touch(session, stream, now_ns)
        flow = negotiate_flow_control(open_.proposed_flow_control, self.local_flow_control)
        stream.flow = flow
        stream.window = flow.credits_granted
        assert stream.plan is not None
        initiator = {shard.COMPRESSION_NONE, *open_.accepted_compression}
        if stream.plan.compression in initiator:
            stream.result_compression = stream.plan.compression
        stream.phase = StreamPhase.OPEN
        self._send(
            out,
            stream,
            responses.accepted(
                schema_version=stream.schema_version,
                session_id=session_id,
                epoch=open_.route_epoch,
                flow=flow,
                compressions=self.accepted_compression,
                fingerprint=self.fingerprint,
            ),
        )

    def _on_answer_open(self, out: list[Action], stream: StreamState, open_: shard.SessionOpen) -> None:
        """A head opened the stream its session's direct answers go to. Only a tail answers; the
        stream holds no session state and takes no share: the route session id, which only the
        route's members know, names the session it serves."""
        if not self.capabilities.is_tail:
            self._terminate(
                out,
                stream,
                errors.refusal(
                    shard.ERROR_CODE_SHARD_RANGE_MISMATCH, "only the tail answers the head directly"
                ),
            )
            return
        stream.session_id = open_.route_session_id
        stream.epoch = open_.route_epoch
        stream.shard_range = range_tuple(open_.shard_range)
        stream.schema_version = min(open_.schema_version, HIGHEST_SCHEMA_VERSION)
        stream.answer_only = True
        stream.flow = negotiate_flow_control(open_.proposed_flow_control, self.local_flow_control)
        stream.phase = StreamPhase.OPEN
        self._answer_streams[(stream.session_id, stream.epoch)] = stream.id
        self._send(
            out,
            stream,
            responses.accepted(
                schema_version=stream.schema_version,
                session_id=stream.session_id,
                epoch=stream.epoch,
                flow=stream.flow,
                compressions=self.accepted_compression,
                fingerprint=self.fingerprint,
            ),
        )

    def _answer_stream(self, session: SessionState) -> StreamState | None:
        """The open answer stream of ``session``'s head, if it opened one."""
        stream_id = self._answer_streams.get((session.session_id, session.epoch))
        stream = None if stream_id is None else self._streams.get(stream_id)
        return stream if stream is not None and stream.phase is StreamPhase.OPEN else None

    def _on_unit(
        self,
        out: list[Action],
        stream: StreamState,
        request: shard.SessionRequest,
        bundle: BundleParts | None,
        kind: str,
        size: int,
        now_ns: int,
        unix_now_ns: int,
    ) -> None:
        flow = stream.flow
        assert flow is not None
        if size > flow.max_chunk_bytes:
            self._terminate(
                out, stream, errors.flow_control_violation(f"unit of {size} bytes over max_chunk_bytes")
            )
            return
        if stream.unacked >= stream.window:
            self._terminate(
                out, stream, errors.flow_control_violation(f"more than {stream.window} un-acked units")
            )
            return
        if kind == "chunk" and request.chunk.envelope.position.token_count > flow.max_prefill_chunk_tokens:
            self._terminate(
                out, stream, errors.flow_control_violation("chunk carries more than max_prefill_chunk_tokens")
            )
            return
        stream.unacked += 1
        if kind == "decode":
            step, work_id = request.decode.idempotency_step, request.decode.work_id
            wire_deadline_ns = request.decode.deadline_unix_nanos
        else:
            step, work_id = request.chunk.envelope.idempotency_step, request.chunk.envelope.work_id
            wire_deadline_ns = request.chunk.envelope.deadline_unix_nanos
        deadline = Deadline.from_unix(wire_deadline_ns, now_ns=now_ns, unix_now_ns=unix_now_ns)
        try:
            if kind == "decode":
                unit = self._decode_unit(out, stream, request.decode, deadline, now_ns)
            else:
                if bundle is None:
                    bundle = bundle_parts_from_pb(request.chunk.bundle)
                unit = self._chunk_unit(out, stream, request.chunk.envelope, bundle, deadline, now_ns)
            self._admit(out, unit, now_ns)
        except ShardProtocolError as error:
            self._status(out, stream, work_id, step, error)
            self._credit_returned(out, stream)
            return
        self._pump(out, now_ns)

    # ------------------------------------------------------------------ building units

    def _decode_unit(
        self,
        out: list[Action],
        stream: StreamState,
        step: shard.DecodeStep,
        deadline: Deadline | None,
        now_ns: int,
    ) -> Unit:
        if step.expected_past_len != step.position:
            raise errors.payload_corrupt("a decode step's position must equal expected_past_len")
        session = self._session_for(out, stream, stream.epoch, now_ns)
        step_input = decode_step_input(step.tensor, session.role, self.accepted_compression)
        return self._new_unit(
            stream,
            session,
            step=step.idempotency_step,
            work_id=step.work_id,
            position=UnitPosition(True, step.position, 1, step.expected_past_len),
            deadline=deadline,
            step_input=step_input,
        )

    def _chunk_unit(
        self,
        out: list[Action],
        stream: StreamState,
        env: shard.Envelope,
        bundle: BundleParts,
        deadline: Deadline | None,
        now_ns: int,
    ) -> Unit:
        self._check_identity(stream, env)
        position = unit_position(env)
        count = position.token_count
        session = self._session_for(out, stream, env.route_epoch, now_ns, defer_switch=True)
        if session.epoch != env.route_epoch:
            # A newer epoch: validate the payload against this stream's role before
            # releasing the old epoch's state for it.
            role = self._role_for(stream.plan, stream.shard_range)
            step_input = decode_chunk_input(bundle, role, count, self.accepted_compression)
            session = self._session_for(out, stream, env.route_epoch, now_ns)
        else:
            step_input = decode_chunk_input(bundle, session.role, count, self.accepted_compression)
        stream.epoch = env.route_epoch
        return self._new_unit(
            stream,
            session,
            step=env.idempotency_step,
            work_id=env.work_id,
            position=position,
            deadline=deadline,
            step_input=step_input,
        )

    def _check_identity(self, stream: StreamState, env: shard.Envelope) -> None:
        if env.schema_version != stream.schema_version:
            raise errors.refusal(
                shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "envelope schema version differs from the negotiated one"
            )
        if env.route_session_id != stream.session_id:
            raise errors.payload_corrupt("envelope names another route session than the stream's")
        if digests(env.fingerprint) != self._digests:
            raise errors.refusal(
                shard.ERROR_CODE_FINGERPRINT_MISMATCH, "fingerprint differs from the served one"
            )
        if range_tuple(env.shard_range) != stream.shard_range:
            raise errors.refusal(
                shard.ERROR_CODE_SHARD_RANGE_MISMATCH, "envelope shard range differs from the session's"
            )

    def _new_unit(
        self,
        stream: StreamState,
        session: SessionState,
        *,
        step: int,
        work_id: str,
        position: UnitPosition,
        deadline: Deadline | None,
        step_input: StepInput | None,
    ) -> Unit:
        unit_id = self._next_unit_id
        self._next_unit_id += 1
        return Unit(
            id=unit_id,
            stream_id=stream.id,
            session=session,
            step=step,
            work_id=work_id,
            position=position,
            deadline=deadline,
            input=step_input,
        )

    # ------------------------------------------------------------------ sessions

    def _role_for(self, plan: RoutePlan | None, shard_range: tuple[int, int, int]) -> HopRole:
        assert plan is not None
        caps = self.capabilities
        return HopRole(
            takes_tokens=shard_range[2] == 0,
            is_tail=caps.is_tail,
            hidden_size=caps.hidden_size,
            vocab_size=caps.vocab_size,
            boundary_dtype=plan.boundary_dtype,
        )

    def _session_for(
        self, out: list[Action], stream: StreamState, epoch: int, now_ns: int, *, defer_switch: bool = False
    ) -> SessionState:
        """The session this stream's unit belongs to at ``epoch``: the live one, a fresh one for a
        newer epoch (the old epoch's state released), or a re-admitted one after a release."""
        session = self._sessions.get(stream.session_id)
        floor = session.epoch if session is not None else self._retired_epochs.get(stream.session_id, 0)
        if epoch < floor:
            raise errors.epoch_stale(floor)
        if session is not None and epoch == session.epoch:
            if (stream.shard_range, stream.route_bytes) != (session.shard_range, session.route_bytes):
                raise errors.refusal(
                    shard.ERROR_CODE_SHARD_RANGE_MISMATCH,
                    "route or range differs from the one this session epoch was opened with",
                )
            return session
        if session is not None:
            if defer_switch:
                return session
            self._cancel_units(out, session, "", errors.epoch_stale(epoch))
            self._drop_session(out, session, ReleaseReason.SUPERSEDED)
        else:
            self._admit_session(stream.origin)
        plan = stream.plan
        assert plan is not None
        fresh = SessionState(
            session_id=stream.session_id,
            epoch=epoch,
            shard_range=stream.shard_range,
            route_bytes=stream.route_bytes,
            plan=plan,
            role=self._role_for(plan, stream.shard_range),
            ledger=StepLedger(self.config.replay_window),
            last_active_ns=now_ns,
            owner=stream.origin,
            owner_stream=stream.id,
            lease_until_ns=now_ns + self.config.session_idle_ttl_ns,
            idle_timeout_ns=self.config.session_idle_ttl_ns,
        )
        self._sessions[stream.session_id] = fresh
        return fresh

    def _admit_session(self, origin: StreamOrigin) -> None:
        refusal = self.admission.refuse_session(
            serving_state=self.serving_state,
            sessions=len(self._sessions),
            peer_sessions=None if origin.local else self.sessions_of(origin.peer_id),
        )
        if refusal is not None:
            self.share_refusals += refusal.share
            raise refusal.error

    def _orphan_unserved(self, origin: StreamOrigin, now_ns: int) -> None:
        """A link of ``origin`` was lost: its sessions that no open stream of it serves (the lost
        stream's, and any whose stream had ended before) wait for it."""
        for session in self._sessions.values():
            if session.owner != origin:
                continue
            serving = self._streams.get(session.owner_stream)
            if serving is None or serving.phase is StreamPhase.CLOSED:
                self._orphan(session, now_ns, ReleaseReason.LINK_CLOSED)

    def _orphan(self, session: SessionState, now_ns: int, reason: ReleaseReason) -> None:
        # The first sign counts: more of them (each poll of membership) do not extend the wait.
        if session.orphaned_until_ns is None:
            session.orphaned_until_ns = now_ns + self.config.owner_grace_ns
            session.orphan_reason = reason

    def _end_session(self, out: list[Action], session: SessionState, reason: ReleaseReason) -> None:
        """End a session nobody will finish: abandon its units, then drop it."""
        self._cancel_units(out, session, "", errors.cancelled(f"session ended: {reason.value}"))
        self._drop_session(out, session, reason)

    def _touch(
        self, session: SessionState, stream: StreamState, now_ns: int, *, sized_by: Unit | None = None
    ) -> None:
        """A frame for ``session`` arrived on ``stream``: its lease runs again, sized by the unit
        it carried (by its deadline, or the default without one); from the owner, it also shows
        the owner is there, on that stream."""
        if session.owner == stream.origin:
            session.owner_stream = stream.id
            session.orphaned_until_ns = session.orphan_reason = None
        if sized_by is not None:
            deadline = sized_by.deadline
            session.idle_timeout_ns = idle_timeout_ns(
                None if deadline is None else deadline.at_ns,
                now_ns,
                default_ns=self.config.session_idle_ttl_ns,
                floor_ns=self.config.session_idle_floor_ns,
            )
        session.lease_until_ns = now_ns + session.idle_timeout_ns

    def _touch_stream_session(self, stream: StreamState, now_ns: int) -> None:
        """A signal on ``stream`` is a frame for the session the stream serves."""
        session = self._sessions.get(stream.session_id)
        if session is not None and session.epoch == stream.epoch:
            self._touch(session, stream, now_ns)

    def _lease_end(self, session: SessionState) -> int:
        # A unit that ran long past its frame's lease still leaves the session the floor after it.
        floor = min(self.config.session_idle_floor_ns, self.config.session_idle_ttl_ns)
        return max(session.lease_until_ns, session.last_active_ns + floor)

    def _drop_session(self, out: list[Action], session: SessionState, reason: ReleaseReason) -> None:
        """Forget the session (its units already answered) and release its engine and next-hop state."""
        self.releases[reason] += 1
        del self._sessions[session.session_id]
        self._forecast.forget(session.session_id)
        self._queued -= len(session.queue)
        session.queue.clear()
        self._refile(session)
        self._retired_epochs[session.session_id] = session.epoch
        self._retired_epochs.move_to_end(session.session_id)
        while len(self._retired_epochs) > RETIRED_EPOCHS_KEPT:
            self._retired_epochs.popitem(last=False)
        out.append(ReleaseEngine(session.key))
        if session.plan.next_hop is not None:
            out.append(ReleaseDownstream(session.key))

    def _busy(self, session: SessionState) -> bool:
        if session.queue or any(u.session is session for u in self._running_units()):
            return True
        return any(u.session is session for u in self._forwarding.values())

    # ------------------------------------------------------------------ admission and scheduling

    def _admit(self, out: list[Action], unit: Unit, now_ns: int) -> None:
        session = unit.session
        stream = self._streams.get(unit.stream_id)
        if stream is not None:
            self._touch(session, stream, now_ns, sized_by=unit)
        position = unit.position
        verdict, record = session.ledger.judge(unit.step, unit.work_id, fresh_start=position.fresh_start)
        if verdict is Verdict.REPLAY:
            assert record is not None
            self._replay(out, unit, record)
            return
        if verdict is not Verdict.ADMIT:
            raise _refusal_for(verdict, session)
        end = position.end
        session_tokens = end if position.fresh_start else max(session.context_tokens, end)
        refusal = self.admission.refuse_unit(
            position_end=end,
            session_tokens=session_tokens,
            tokens_in_use=sum(s.context_tokens for s in self._sessions.values()) - session.context_tokens,
            queued=self._queued,
        )
        if refusal is not None:
            raise refusal
        session.context_tokens = session_tokens
        session.ledger.admitted(unit.step)
        session.last_active_ns = now_ns
        unit.arrived_ns = now_ns
        self._forecast.arrived(session.session_id, now_ns)
        session.queue.append(unit)
        self._queued += 1
        if len(session.queue) == 1:
            self._refile(session)

    def _refile(self, session: SessionState) -> None:
        """``session``'s queue head changed: tell the scheduler what it now is (or that it is gone)."""
        if not session.queue:
            # Only if it is the one filed: a session of an older epoch must not unfile its successor.
            if self._ready.get(session.session_id) is session:
                del self._ready[session.session_id]
                self._scheduler.remove(session.session_id)
            return
        self._ready[session.session_id] = session
        head = session.queue[0].position
        # A verify step is a multi-token forward run alone, as a prefill chunk is: filed as one.
        self._scheduler.file(
            session.session_id, session.owner, decode=head.single_decode, tokens=head.token_count
        )

    def _pump(self, out: list[Action], now_ns: int) -> None:
        while self._running is None and self._ready and not self._holding(now_ns):
            self._start_batch(out, now_ns)

    def _holding(self, now_ns: int) -> bool:
        """Whether the free engine waits for sessions due back within about one batch
        (meshnode.dataplane.arrival_forecast), so that they share the next batch instead of
        taking turns; each wait has one end, fixed when it begins. Never while pipeline cohorts
        are in force: they move on as they come, and waiting for the sessions due back would
        gather them into one convoy again (meshnode.dataplane.cohorts)."""
        if self._cohort_limit() is not None:
            self._hold_until_ns = None
            return False
        if self._hold_until_ns is not None:
            if now_ns < self._hold_until_ns and self._forecast.due_within(
                self._ready, now_ns, self._hold_horizon()
            ):
                return True
            self._hold_until_ns = None
            return False
        if len(self._ready) >= self.batch_limits.max_units:
            return False
        due = self._forecast.due_within(self._ready, now_ns, self._hold_horizon())
        if due is None or due <= now_ns:
            return False
        self._hold_until_ns = due
        return True

    def _cohort_limit(self) -> int | None:
        """A pipeline cohort's size when the sessions held ask for cohorts (meshnode.dataplane.cohorts)."""
        return cohort_limit(s.plan.pipeline_stages for s in self._sessions.values() if s.plan is not None)

    def _batch_room(self) -> int:
        """Units the next batch may take: the engine's limit, or a pipeline cohort's."""
        cohort = self._cohort_limit()
        limit = self.batch_limits.max_units
        return limit if cohort is None else min(limit, cohort)

    def _hold_horizon(self) -> int:
        share = self.config.batch_hold_share
        return min(round(self._last_batch_ns * share), self.config.max_batch_hold_ns) if share > 0 else 0

    def _start_batch(self, out: list[Action], now_ns: int) -> None:
        """Form the next batch from the sessions' head units, in the scheduler's fair order, and
        ask the edge to run it. A head unit refused before the engine (deadline, replay, cache
        miss) takes no room; its session's next unit waits for the next batch, whose plan sees
        what that unit is. Every call takes at least one unit off a queue, so the pump ends."""
        plan = self._scheduler.plan(max_units=self._batch_room())
        units: list[Unit] = []
        steps: list[BatchStep] = []
        while (session_id := plan.next()) is not None:
            session = self._ready[session_id]
            unit = session.queue.popleft()
            self._queued -= 1
            step = self._prepare(out, unit, now_ns)
            if step is not None:
                plan.accept(session_id)
                units.append(unit)
                steps.append(step)
            self._refile(session)
        if not units:
            return
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._running = RunningBatch(batch_id, units)
        decodes = sum(1 for step in steps if step.decode)
        self.batch_stats.started(
            decodes=decodes,
            prefills=len(steps) - decodes,
            tokens=plan.tokens,
            waits_ns=[now_ns - unit.arrived_ns for unit in units],
            now_ns=now_ns,
        )
        out.append(RunBatch(batch_id, tuple(u.id for u in units), tuple(steps)))

    def _prepare(self, out: list[Action], unit: Unit, now_ns: int) -> BatchStep | None:
        """The engine step for a unit leaving its queue, or None when it was answered instead."""
        session = unit.session
        if _passed(unit.deadline, now_ns):
            self._fail(out, unit, errors.deadline_exceeded())
            return None
        position = unit.position
        verdict, record = session.ledger.judge(unit.step, unit.work_id, fresh_start=position.fresh_start)
        if verdict is Verdict.REPLAY:
            assert record is not None
            self._replay(out, unit, record)
            return None
        if verdict is not Verdict.ADMIT:
            self._fail(out, unit, _refusal_for(verdict, session))
            return None
        expected = position.expected_past_len
        refusal = self._cache_refusal(session, position)
        if refusal is not None:
            self._fail(out, unit, refusal)
            return None
        assert unit.input is not None
        # A token per unit, so that cancelling one unit leaves the rest of its batch running.
        token = CancelToken()
        sample = position.final and session.role.is_tail
        try:
            request = StepRequest(
                session=session.key,
                first_position=position.first_position,
                token_ids=unit.input.token_ids,
                hidden=unit.input.hidden,
                expected_past_len=expected if position.decode else None,
                effective_start_layer=session.shard_range[2],
                sampling=session.plan.sampling if sample else None,
                want_logits=sample and session.plan.return_logits,
                sample_index=position.end,
                work_id=unit.work_id,
                cancel_token=token,
                draft_tokens=position.draft_tokens,
                rollback=position.rollback,
            )
        except EngineError as error:
            self._fail(out, unit, errors.from_engine_failure(error))
            return None
        unit.token = token
        unit.input = None
        # A verify step runs through the engine's multi-token (prefill) path, alone.
        return BatchStep(request, position.single_decode)

    @staticmethod
    def _cache_refusal(session: SessionState, position: UnitPosition) -> ShardProtocolError | None:
        """The CACHE_MISS a unit meets before the engine, by what this worker knows the engine holds
        (nothing when it does not know: the engine then decides, by the same rule)."""
        expected, held = position.expected_past_len, session.past_len
        if expected is None or held is None or held == expected:
            return None
        if not position.rollback:
            return errors.cache_miss(f"session holds {held} tokens, not {expected}", held)
        if session.committed_len is None:
            return None
        refusal = rollback_refusal(held, session.committed_len, expected)
        return None if refusal is None else errors.cache_miss(refusal, held)

    # ------------------------------------------------------------------ results

    def _applied(self, out: list[Action], unit: Unit, result: StepResult) -> None:
        session = unit.session
        session.past_len = result.past_len
        session.committed_len = result.past_len - unit.position.draft_tokens
        cache = shard.CacheResult(
            mode=shard.CACHE_MODE_PREFILL if unit.position.fresh_start else shard.CACHE_MODE_DECODE,
            past_len=result.past_len,
            cache_hit=result.cache_hit,
        )
        plan = session.plan
        if plan.next_hop is None:
            bundle = self._result_bundle(unit, result)
            record = StepRecord(
                unit.step,
                unit.work_id,
                cache,
                result.execution_nanos,
                RecordState.COMPLETE,
                result=None if bundle is None else self._result_chunk(unit, bundle),
            )
            session.ledger.applied(record)
            self._succeed(out, unit, record, duplicate=False)
            return
        assert result.hidden is not None and plan.onward is not None
        work = ForwardWork(
            step=unit.step,
            work_id=unit.work_id,
            position=unit.position,
            deadline=unit.deadline,
            hidden=result.hidden,
        )
        record = StepRecord(
            unit.step, unit.work_id, cache, result.execution_nanos, RecordState.FORWARDING, forward=work
        )
        if unit.answered:
            # Nobody waits for it (deadline, cancel); a retry of the step re-forwards it.
            record.state = RecordState.FORWARD_FAILED
            session.ledger.applied(record)
            return
        session.ledger.applied(record)
        self._forward(out, unit, record, work)

    def _forward(self, out: list[Action], unit: Unit, record: StepRecord, work: ForwardWork) -> None:
        plan = unit.session.plan
        assert plan.next_hop is not None and plan.onward is not None
        record.state = RecordState.FORWARDING
        unit.record = record
        self._forwarding[unit.id] = unit
        out.append(Forward(unit.id, unit.session.key, plan.next_hop, plan.onward, work))

    def _result_bundle(self, unit: Unit, result: StepResult) -> shard.TensorBundle | None:
        role = unit.session.role
        if role.is_tail:
            if result.token_id is None:
                return None
            logits = result.logits if unit.session.plan.return_logits else None
            if unit.position.verify and result.token_ids is not None:
                return encode_verify_result(tuple(int(t) for t in result.token_ids), logits)
            return encode_token_result(int(result.token_id), logits)
        assert result.hidden is not None
        stream = self._streams.get(unit.stream_id)
        compression = stream.result_compression if stream is not None else shard.COMPRESSION_NONE
        return encode_bundle([encode_hidden(result.hidden, role.boundary_dtype, compression)])

    @staticmethod
    def _result_chunk(unit: Unit, bundle: shard.TensorBundle) -> shard.SessionResponse:
        return responses.result_chunk(
            work_id=unit.work_id,
            session_id=unit.session.session_id,
            epoch=unit.session.epoch,
            step=unit.step,
            decode=unit.position.decode,
            first_position=unit.position.first_position,
            token_count=unit.position.token_count,
            bundle=bundle,
        )

    def _replay(self, out: list[Action], unit: Unit, record: StepRecord) -> None:
        """Answer a step that was already applied here, without applying it again."""
        unit.replay = True
        unit.input = None
        if record.state is RecordState.COMPLETE:
            self._succeed(out, unit, record, duplicate=True)
        elif record.state is RecordState.FORWARDING:
            record.followers.append(unit)
            self._followers[unit.id] = unit
        else:
            work = replace(record.forward, deadline=unit.deadline)
            record.forward = work
            self._forward(out, unit, record, work)

    # ------------------------------------------------------------------ answers

    def _succeed(self, out: list[Action], unit: Unit, record: StepRecord, *, duplicate: bool) -> None:
        if unit.answered:
            return
        unit.answered = True
        stream = self._streams.get(unit.stream_id)
        if stream is None or stream.phase is not StreamPhase.OPEN:
            return
        answered_directly = record.answered_directly
        if record.result is not None:
            # The tail's token goes straight to the head when the head opened an answer stream;
            # the sender still gets its Ack (credit, cache position) on its own stream.
            answers = self._answer_stream(unit.session)
            if answers is not None:
                out.append(Send(answers.id, record.result))
                answered_directly = True
                self.direct_answers += 1
            else:
                out.append(Send(stream.id, record.result))
        ack = responses.ack(
            unit.work_id,
            unit.step,
            record.cache_result,
            duplicate=duplicate,
            execution_nanos=record.execution_nanos,
            answered_directly=answered_directly,
        )
        out.append(Send(stream.id, ack))
        self._credit_returned(out, stream)

    def _fail(self, out: list[Action], unit: Unit, error: ShardProtocolError) -> None:
        if unit.answered:
            return
        unit.answered = True
        stream = self._streams.get(unit.stream_id)
        if stream is None or stream.phase is not StreamPhase.OPEN:
            return
        self._status(out, stream, unit.work_id, unit.step, error)
        self._credit_returned(out, stream)

    def _status(
        self,
        out: list[Action],
        stream: StreamState,
        work_id: str,
        step: int,
        error: ShardProtocolError,
        *,
        terminal: bool = False,
    ) -> None:
        self._send(out, stream, responses.status(work_id, stream.session_id, step, error, terminal=terminal))

    def _credit_returned(self, out: list[Action], stream: StreamState) -> None:
        stream.unacked -= 1
        flow = stream.flow
        assert flow is not None
        # Widen the window toward max_inflight_chunks while the worker has headroom.
        if stream.window < flow.max_inflight_chunks and self._queued < self.config.max_queue_depth // 2:
            stream.window += 1
            self._send(out, stream, responses.credit_grant(flow, 1))

    def _send(self, out: list[Action], stream: StreamState, response: shard.SessionResponse) -> None:
        if stream.phase is not StreamPhase.CLOSED:
            out.append(Send(stream.id, response))

    def _terminate(self, out: list[Action], stream: StreamState, error: ShardProtocolError) -> None:
        self._status(out, stream, "", 0, error, terminal=True)
        out.append(CloseStream(stream.id, error.code_name))
        self._drop_stream(stream)

    def _drop_stream(self, stream: StreamState) -> None:
        stream.phase = StreamPhase.CLOSED
        if stream.answer_only:
            key = (stream.session_id, stream.epoch)
            if self._answer_streams.get(key) == stream.id:
                del self._answer_streams[key]
            return
        session = self._sessions.get(stream.session_id)
        if session is not None:
            mine = [u for u in session.queue if u.stream_id == stream.id]
            if mine:
                self._unqueue(session, mine)

    def _unqueue(self, session: SessionState, units: list[Unit]) -> None:
        gone = {u.id for u in units}
        head = session.queue[0] if session.queue else None
        session.queue = deque(u for u in session.queue if u.id not in gone)
        self._queued -= len(gone)
        if not session.queue or session.queue[0] is not head:
            self._refile(session)

    def _cancel_units(
        self, out: list[Action], session: SessionState, work_id: str, error: ShardProtocolError
    ) -> int:
        def matches(unit: Unit) -> bool:
            return not unit.answered and (not work_id or unit.work_id == work_id)

        count = 0
        for running in self._running_units():
            if running.session is session and matches(running):
                # This unit's token only: the other sessions' units in the batch are not touched.
                assert running.token is not None
                out.append(FireCancel(running.id, running.token))
                self._fail(out, running, error)
                count += 1
        queued = [u for u in session.queue if matches(u)]
        if queued:
            self._unqueue(session, queued)
            for unit in queued:
                self._fail(out, unit, error)
            count += len(queued)
        forwarded = [u for u in self._forwarding.values() if u.session is session and matches(u)]
        followers = [u for u in self._followers.values() if u.session is session and matches(u)]
        for unit in [*forwarded, *followers]:
            self._fail(out, unit, error)
        count += len(forwarded) + len(followers)
        if forwarded:
            out.append(CancelDownstream(session.key, work_id))
        return count

    def _units_in_flight(self) -> list[Unit]:
        units = [u for s in self._ready.values() for u in s.queue]
        units.extend(self._running_units())
        units.extend(self._forwarding.values())
        units.extend(self._followers.values())
        return units

    def _running_units(self) -> list[Unit]:
        return self._running.units if self._running is not None else []


def _passed(deadline: Deadline | None, now_ns: int) -> bool:
    return deadline is not None and now_ns >= deadline.at_ns


def _refusal_for(verdict: Verdict, session: SessionState) -> ShardProtocolError:
    actual = session.past_len or 0
    if verdict is Verdict.UNSET:
        return errors.payload_corrupt("idempotency_step 0 is unset; steps start at 1")
    if verdict is Verdict.GAP:
        return errors.cache_miss(
            f"step skips ahead of step {session.ledger.highest_admitted}; re-prefill from position 0", actual
        )
    if verdict is Verdict.REUSED_STEP:
        return errors.cache_miss("step was already applied for other work", actual)
    return errors.cache_miss("the session moved past this step", actual)


def _downstream_error(outcome: object) -> ShardProtocolError:
    if isinstance(outcome, ShardProtocolError):
        # The next hop's code and retry advice travel on; its detail text does not.
        return errors.refusal(
            outcome.code,
            f"next hop refused: {outcome.code_name}",
            retryable=outcome.retryable,
            actual_past_len=outcome.actual_past_len,
        )
    return errors.refusal(shard.ERROR_CODE_INTERNAL, "next hop unreachable", retryable=True)


__all__ = [
    "HIGHEST_SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "DownstreamResult",
    "ShardWorker",
    "WorkerConfig",
    "WorkerLoad",
]
