"""The worker side of the shard session protocol, sans-IO.

How it is cut: :class:`ShardWorker` reads frames and composes parts that each own their
state and never call back into it — :class:`~.stream_table.StreamTable` (streams, replies,
credit, direct answers), :class:`~.session_table.SessionTable` (sessions, epochs, leases),
:class:`~.admission.AdmissionPolicy` (pure limits), :class:`~.batch_former.BatchFormer`
(queues, the fair round robin, the hold, the running batch) and
:class:`~.unit_runner.UnitRunner` (batches, results, forwarding, replay, giving units up).
Which message a stream may carry in which phase is the table in :mod:`.stream_rules`.

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
- Commitments (meshnode.audit.commitment): a worker given the node key signs, for every unit
  its engine applies, the chained digest of the session's inputs and the digest of its output,
  and its Ack carries that commitment followed by those the next hop's Ack carried (at most as
  many as the route has hops after this one; passed on unchecked: the head checks them). A
  duplicate is answered with the record's commitments. Nothing in a unit says whether it will
  be audited, so every unit is committed to the same way.
- The admin's mesh policy (:mod:`.hop_rules`, read from the node at each route and each unit
  without a handoff): a route naming a quarantined node after this hop is refused before the
  open (PAYLOAD_CORRUPT), and so is a float32 unit without a handoff where handoffs are required.
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

from collections import Counter
from dataclasses import dataclass

from engines.interface import EngineCapabilities
from meshnode.audit.commitment import CommitmentSigner
from meshnode.dataplane import errors, responses
from meshnode.dataplane.actions import Action, DownstreamResult
from meshnode.dataplane.admission import AdmissionPolicy
from meshnode.dataplane.batch_former import BatchFormer
from meshnode.dataplane.batch_stats import BatchStats
from meshnode.dataplane.batching import BatchLimits
from meshnode.dataplane.envelope import (
    HIGHEST_SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    Deadline,
    UnitPosition,
    digests,
    fingerprint_message,
    range_tuple,
    unit_position,
)
from meshnode.dataplane.handoff_check import checked_handoff
from meshnode.dataplane.hop_rules import NO_RULES, HopRules, quarantined_hop_refusal
from meshnode.dataplane.lease import LOCAL_ORIGIN, ReleaseReason, StreamOrigin, peer_session_cap
from meshnode.dataplane.payload import StepInput, decode_chunk_input, decode_step_input
from meshnode.dataplane.request_reader import ReadRequest, read_request, read_route
from meshnode.dataplane.route import validate_route
from meshnode.dataplane.session_keeper import SessionKeeper
from meshnode.dataplane.session_table import LeaseRules, SessionTable
from meshnode.dataplane.steps import Verdict
from meshnode.dataplane.stream_rules import (
    Move,
    envelope_refusal,
    open_refusal,
    request_move,
    unit_flow_refusal,
)
from meshnode.dataplane.stream_table import StreamTable
from meshnode.dataplane.unit_runner import UnitRunner
from meshnode.dataplane.unit_steps import verdict_refusal
from meshnode.dataplane.worker_state import SessionState, StreamPhase, StreamState, Unit
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.identity import NodeIdentity
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.flow_control import default_flow_control, negotiate_flow_control
from meshnode.wire.pb import shard
from meshnode.wire.tensor_parts import BundleParts, bundle_parts_from_pb


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
class WorkerLoad:
    active_sessions: int
    queued_units: int
    running_units: int
    serving_state: int


class ShardWorker:
    """Node-wide session protocol state for one served shard. See the module docstring."""

    def __init__(
        self,
        capabilities: EngineCapabilities,
        config: WorkerConfig | None = None,
        *,
        identity: NodeIdentity | None = None,
        rules: HopRules = NO_RULES,
    ) -> None:
        """``identity``: the node key that signs this hop's unit commitments (None: it signs none).
        ``rules``: what the admin's mesh policy asks of this hop, read when it matters."""
        self.rules = rules
        self.capabilities = capabilities
        self.config = config = config or WorkerConfig()
        self.local_flow_control = config.flow_control or default_flow_control()
        self.accepted_compression = tuple(sorted({shard.COMPRESSION_NONE, *config.accepted_compression}))
        max_sessions = config.max_sessions if config.max_sessions is not None else capabilities.max_sessions
        # What the worker admits: its limits live in the policy alone (max_sessions reads them).
        admission = AdmissionPolicy(
            max_sessions=max_sessions,
            peer_session_cap=peer_session_cap(config.peer_session_share, max_sessions),
            max_context_tokens=capabilities.max_context_tokens,
            max_total_context_tokens=config.max_total_context_tokens,
            max_queue_depth=config.max_queue_depth,
        )
        self.fingerprint = fingerprint_message(capabilities.fingerprint)
        self._digests = digests(self.fingerprint)
        self.batch_limits = config.batch_limits or BatchLimits(
            max_units=max(1, max_sessions),
            max_tokens=max(1, max_sessions) + self.local_flow_control.max_prefill_chunk_tokens,
        )
        # What the edge is to carry out, in order, until it calls take_events(); every part says
        # what it has to say here.
        self._outbox: list[Action] = []
        self._sessions = SessionTable(
            LeaseRules(
                idle_ttl_ns=config.session_idle_ttl_ns,
                idle_floor_ns=config.session_idle_floor_ns,
                owner_grace_ns=config.owner_grace_ns,
                replay_window=config.replay_window,
            )
        )
        self._batches = BatchFormer(
            self.batch_limits, hold_share=config.batch_hold_share, max_hold_ns=config.max_batch_hold_ns
        )
        self._streams = StreamTable(self._outbox, self._batches, max_queue_depth=config.max_queue_depth)
        signer = (
            None
            if identity is None
            else CommitmentSigner.for_engine(
                identity, self.fingerprint, exact=capabilities.exact_numerics, numerics=capabilities.numerics
            )
        )
        self._units = UnitRunner(self._outbox, self._sessions, self._streams, self._batches, signer)
        self._keeper = SessionKeeper(
            capabilities, admission, self._outbox, self._sessions, self._batches, self._units
        )
        self._next_unit_id = 1

    # ------------------------------------------------------------------ public API

    @property
    def admission(self) -> AdmissionPolicy:
        return self._keeper.admission

    @admission.setter
    def admission(self, policy: AdmissionPolicy) -> None:
        """New limits for what comes next; sessions and units already admitted stay."""
        self._keeper.admission = policy

    @property
    def max_sessions(self) -> int:
        """Sessions this worker holds at once (its admission policy's)."""
        return self.admission.max_sessions

    @property
    def serving_state(self) -> int:
        return self._keeper.serving_state

    @property
    def share_refusals(self) -> int:
        """Opens refused for a peer over its share (for /metrics)."""
        return self._keeper.share_refusals

    @property
    def releases(self) -> Counter[ReleaseReason]:
        """Sessions ended, by why (for /metrics)."""
        return self._sessions.releases

    @property
    def direct_answers(self) -> int:
        """Results sent straight to a session's head on its answer stream (direct answer)."""
        return self._streams.direct_answers

    @property
    def batch_stats(self) -> BatchStats:
        return self._batches.stats

    def set_serving_state(self, state: int) -> None:
        """SERVING accepts new sessions; DRAINING and NOT_SERVING refuse them, existing ones continue."""
        self._keeper.serving_state = state

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            active_sessions=len(self._sessions),
            queued_units=self._batches.queued,
            running_units=len(self._batches.running_units()),
            serving_state=self.serving_state,
        )

    def take_events(self) -> list[Action]:
        """The actions every call since the last one produced, in order, for the edge to carry out."""
        events = list(self._outbox)
        self._outbox.clear()
        return events

    def open_stream(self, origin: StreamOrigin = LOCAL_ORIGIN) -> int:
        """Register an accepted SHARD_SESSION stream (or relay channel) from ``origin``; returns its id."""
        return self._streams.open(origin)

    def peer_departed(self, peer_id: bytes, now_ns: int) -> None:
        """Membership confirmed ``peer_id`` down, or it left: the sessions it opened end
        ``owner_grace_ns`` from now unless it shows up for them again."""
        for session in self._sessions.owned_by_peer(peer_id):
            self._sessions.orphan(session, now_ns, ReleaseReason.OWNER_DEPARTED)
        self.handle_timer(now_ns)  # with no grace they end now; otherwise the timer ends them

    def owners(self) -> set[bytes]:
        """The peers (other than this node) that hold sessions here."""
        return self._sessions.owners()

    def sessions_of(self, peer_id: bytes) -> int:
        """Sessions that ``peer_id`` holds here as a peer (its share's measure)."""
        return self._sessions.sessions_of(peer_id)

    def session_epoch(self, session_id: str) -> int | None:
        session = self._sessions.get(session_id)
        return None if session is None else session.epoch

    def receive_frame(self, stream_id: int, body: bytes, now_ns: int, *, unix_now_ns: int) -> None:
        """One frame body from the stream: the route first, then SessionRequests. A unit's
        deadline is read against ``unix_now_ns``, the wall clock at ``now_ns``."""
        stream = self._streams[stream_id]
        if stream.phase is StreamPhase.CLOSED:
            return
        if stream.phase is StreamPhase.AWAIT_ROUTE:
            route = read_route(body)
            if isinstance(route, ShardProtocolError):
                self._terminate(stream, route)
            else:
                self._on_route(stream, route)
            return
        read = read_request(body)
        if isinstance(read, ShardProtocolError):
            self._terminate(stream, read)
        else:
            self._on_request(stream, read, now_ns, unix_now_ns)

    def stream_closed(self, stream_id: int, now_ns: int, *, link_lost: bool = False) -> None:
        """The transport finished or lost the stream. Its queued units are dropped (never applied);
        a running or forwarding unit completes and is recorded for a retry on another stream.

        ``link_lost``: the stream ended because its link closed. The sessions of that stream's
        peer that no other open stream of the peer serves then end ``owner_grace_ns`` from now
        (their KV freed) unless the peer shows up for them again."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._drop_stream(stream)
            self._streams.remove(stream_id)
            if link_lost:
                # Its sessions that no open stream of the peer serves (the lost stream's, and any
                # whose stream had ended before) wait for it.
                for session in self._sessions.owned_by(stream.origin):
                    if not self._streams.serves(session.owner_stream):
                        self._sessions.orphan(session, now_ns, ReleaseReason.LINK_CLOSED)
        self._units.pump(now_ns)
        if link_lost:
            self.handle_timer(now_ns)  # with no grace they end now; otherwise the timer ends them

    def batch_finished(self, batch_id: int, outcomes: object, now_ns: int) -> None:
        """Report a RunBatch: ``outcomes`` is the list the engine returned (a StepResult or an
        EngineError per unit, in the batch's order), or the exception that failed the whole
        batch, which then fails each of its units as that exception would have failed it alone."""
        self._units.batch_finished(batch_id, outcomes, now_ns)

    def downstream_finished(self, unit_id: int, outcome: object, now_ns: int) -> None:
        """Report a Forward: a :class:`DownstreamResult`, or the error the next hop's client raised
        (``ShardProtocolError`` for a refusal, anything else for a transport failure)."""
        self._units.downstream_finished(unit_id, outcome, now_ns)

    def handle_timer(self, now_ns: int) -> None:
        """Expire deadlines and idle sessions at ``now_ns``."""
        self._units.expire(now_ns)
        for session, reason, orphaned in self._sessions.due(now_ns, self._units.busy_sessions()):
            # An orphan's units, busy or not, can no longer reach its owner.
            abandon = errors.cancelled(f"session ended: {reason.value}") if orphaned else None
            self._keeper.end(session, reason, abandon)
        self._units.pump(now_ns)

    def get_timer(self) -> int | None:
        """When :meth:`handle_timer` next has work to do (monotonic ns), or None."""
        times = [
            self._units.next_deadline(),
            self._sessions.next_due(self._units.busy_sessions()),
            self._batches.hold_until_ns,
        ]
        return min([t for t in times if t is not None], default=None)  # a list: no generator to resume

    def cancel(self, session_id: str, epoch: int, work_id: str, now_ns: int) -> int:
        """Abandon the session's running, queued and forwarding units (only ``work_id`` if given).

        Each gets a CANCELLED status on its stream; returns how many. Nothing at that
        epoch (unknown session, other epoch) cancels nothing.
        """
        session = self._sessions.at_epoch(session_id, epoch)
        if session is None:
            return 0
        count = self._units.cancel(session, work_id, errors.cancelled("cancelled by the peer"))
        self._units.pump(now_ns)
        return count

    def release(self, session_id: str, epoch: int, now_ns: int) -> bool:
        """Drop the session's state; False (not an error) when there was none at that epoch."""
        session = self._sessions.at_epoch(session_id, epoch)
        if session is None:
            return False
        self._keeper.end(session, ReleaseReason.RELEASED, errors.cancelled("session released"))
        self._units.pump(now_ns)
        return True

    # ------------------------------------------------------------------ stream messages

    def _on_route(self, stream: StreamState, route: dataplane.SessionRoute) -> None:
        caps = self.capabilities
        try:
            stream.plan = validate_route(route, end_layer=caps.layer_end, is_tail=caps.is_tail)
        except ShardProtocolError as error:
            self._terminate(stream, error)
            return
        quarantined = quarantined_hop_refusal(route.downstream, self.rules.quarantined())
        if quarantined is not None:
            self._terminate(stream, quarantined)
            return
        stream.route_bytes = route.SerializeToString(deterministic=True)
        stream.phase = StreamPhase.AWAIT_OPEN

    def _on_request(self, stream: StreamState, read: ReadRequest, now_ns: int, unix_now_ns: int) -> None:
        request = read.request
        move = request_move(stream, read.kind)
        if isinstance(move, ShardProtocolError):
            self._terminate(stream, move)
        elif move is Move.OPEN:
            self._on_open(stream, request.open, now_ns)
        elif move is Move.UNIT:
            self._on_unit(stream, read, now_ns, unix_now_ns)
        elif move is Move.CANCEL:
            signal = request.cancel
            self._sessions.touch_by_signal(stream, now_ns)
            if self._signal_fits(stream, signal.route_session_id, signal.work_id):
                self.cancel(stream.session_id, signal.route_epoch, signal.work_id, now_ns)
        elif move is Move.RELEASE:
            release = request.release
            if self._signal_fits(stream, release.route_session_id, release.work_id):
                self.release(stream.session_id, release.route_epoch, now_ns)
        else:
            self._sessions.touch_by_signal(stream, now_ns)

    def _signal_fits(self, stream: StreamState, session_id: str, work_id: str) -> bool:
        if session_id == stream.session_id:
            return True
        self._streams.status(stream, work_id, 0, errors.payload_corrupt("signal names another session"))
        return False

    def _on_open(self, stream: StreamState, open_: shard.SessionOpen, now_ns: int) -> None:
        refusal = open_refusal(
            open_, self.capabilities, self._digests, max_session_id_length=self.config.max_session_id_length
        )
        if refusal is not None:
            self._terminate(stream, refusal)
            return
        stream.session_id = open_.route_session_id
        stream.epoch = open_.route_epoch
        stream.shard_range = range_tuple(open_.shard_range)
        stream.schema_version = min(open_.schema_version, HIGHEST_SCHEMA_VERSION)
        stream.flow = negotiate_flow_control(open_.proposed_flow_control, self.local_flow_control)
        if open_.answer_stream:
            # The stream a head opened for its session's direct answers: it holds no session state
            # and takes no share; the route session id, which only the route's members know,
            # names the session it serves.
            stream.answer_only = True
            self._streams.take_answers(stream)
        else:
            try:
                session = self._keeper.session_for(stream, open_.route_epoch, now_ns)
            except ShardProtocolError as error:
                self._terminate(stream, error)
                return
            self._sessions.touch(session, stream, now_ns)
            stream.window = stream.flow.credits_granted
            assert stream.plan is not None
            if stream.plan.compression in {shard.COMPRESSION_NONE, *open_.accepted_compression}:
                stream.result_compression = stream.plan.compression
        stream.phase = StreamPhase.OPEN
        accepted = responses.accepted(
            schema_version=stream.schema_version,
            session_id=stream.session_id,
            epoch=stream.epoch,
            flow=stream.flow,
            compressions=self.accepted_compression,
            fingerprint=self.fingerprint,
        )
        self._streams.send(stream, accepted)

    def _on_unit(self, stream: StreamState, read: ReadRequest, now_ns: int, unix_now_ns: int) -> None:
        request, kind, bundle = read.request, read.kind, read.bundle
        violation = unit_flow_refusal(stream, request, kind, read.size)
        if violation is not None:
            self._terminate(stream, violation)
            return
        stream.unacked += 1
        step, work_id, deadline_unix_ns = read.unit_label()
        deadline = Deadline.from_unix(deadline_unix_ns, now_ns=now_ns, unix_now_ns=unix_now_ns)
        try:
            if kind == "decode":
                unit = self._decode_unit(stream, request.decode, deadline, now_ns)
            else:
                parts = bundle if bundle is not None else bundle_parts_from_pb(request.chunk.bundle)
                unit = self._chunk_unit(stream, request.chunk.envelope, parts, deadline, now_ns)
            self._admit(unit, now_ns)
        except ShardProtocolError as error:
            self._streams.refuse_unit(stream, work_id, step, error)
            return
        self._units.pump(now_ns)

    # ------------------------------------------------------------------ units and their sessions

    def _decode_unit(
        self, stream: StreamState, step: shard.DecodeStep, deadline: Deadline | None, now_ns: int
    ) -> Unit:
        if step.expected_past_len != step.position:
            raise errors.payload_corrupt("a decode step's position must equal expected_past_len")
        session = self._keeper.session_for(stream, stream.epoch, now_ns)
        step_input = decode_step_input(step.tensor, session.role, self.accepted_compression)
        position = UnitPosition(True, step.position, 1, step.expected_past_len)
        unit = self._new_unit(
            stream, session, step.idempotency_step, step.work_id, position, deadline, step_input
        )
        handoff = step.handoff if step.HasField("handoff") else None
        unit.input_handoff = checked_handoff(handoff, unit, required=self.rules.requires_handoffs())
        return unit

    def _chunk_unit(
        self,
        stream: StreamState,
        env: shard.Envelope,
        bundle: BundleParts,
        deadline: Deadline | None,
        now_ns: int,
    ) -> Unit:
        refusal = envelope_refusal(stream, env, self._digests)
        if refusal is not None:
            raise refusal
        position = unit_position(env)
        count = position.token_count
        session = self._keeper.session_for(stream, env.route_epoch, now_ns, defer_switch=True)
        if session.epoch != env.route_epoch:
            # A newer epoch: validate the payload against this stream's role before
            # releasing the old epoch's state for it.
            role = self._keeper.role_for(stream)
            step_input = decode_chunk_input(bundle, role, count, self.accepted_compression)
            session = self._keeper.session_for(stream, env.route_epoch, now_ns)
        else:
            step_input = decode_chunk_input(bundle, session.role, count, self.accepted_compression)
        stream.epoch = env.route_epoch
        unit = self._new_unit(
            stream, session, env.idempotency_step, env.work_id, position, deadline, step_input
        )
        handoff = env.handoff if env.HasField("handoff") else None
        unit.input_handoff = checked_handoff(handoff, unit, required=self.rules.requires_handoffs())
        return unit

    def _new_unit(
        self,
        stream: StreamState,
        session: SessionState,
        step: int,
        work_id: str,
        position: UnitPosition,
        deadline: Deadline | None,
        step_input: StepInput,
    ) -> Unit:
        unit_id = self._next_unit_id
        self._next_unit_id += 1
        return Unit(unit_id, stream.id, session, step, work_id, position, deadline, step_input)

    def _admit(self, unit: Unit, now_ns: int) -> None:
        """Queue ``unit`` for the engine, answer it from its record when it is a retry of an
        applied step, or raise the refusal the ledger or the admission policy gives it."""
        session = unit.session
        stream = self._streams.get(unit.stream_id)
        if stream is not None:
            deadline_at = None if unit.deadline is None else unit.deadline.at_ns
            self._sessions.touch_for_unit(session, stream, now_ns, deadline_at)
        position = unit.position
        verdict, record = session.ledger.judge(unit.step, unit.work_id, fresh_start=position.fresh_start)
        if verdict is Verdict.REPLAY:
            assert record is not None
            self._units.replay(unit, record)
            return
        if verdict is not Verdict.ADMIT:
            raise verdict_refusal(verdict, session)
        end = position.end
        session_tokens = end if position.fresh_start else max(session.context_tokens, end)
        refusal = self.admission.refuse_unit(
            position_end=end,
            session_tokens=session_tokens,
            tokens_in_use=self._sessions.context_tokens() - session.context_tokens,
            queued=self._batches.queued,
        )
        if refusal is not None:
            raise refusal
        session.context_tokens = session_tokens
        session.ledger.admitted(unit.step)
        session.last_active_ns = now_ns
        self._batches.enqueue(unit, now_ns)

    def _terminate(self, stream: StreamState, error: ShardProtocolError) -> None:
        self._streams.terminate(stream, error)
        self._drop_stream(stream)

    def _drop_stream(self, stream: StreamState) -> None:
        """``stream`` is closed: its units still queued are dropped, never applied."""
        self._streams.close(stream)
        if stream.answer_only:
            return
        session = self._sessions.get(stream.session_id)
        if session is not None:
            mine = [u for u in session.queue if u.stream_id == stream.id]
            if mine:
                self._batches.unqueue(session, mine)


__all__ = [
    "HIGHEST_SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "DownstreamResult",
    "ShardWorker",
    "WorkerConfig",
    "WorkerLoad",
]
