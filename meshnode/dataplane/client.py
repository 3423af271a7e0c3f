"""The sender side of the shard session protocol, sans-IO: what a head or a forwarding worker uses.

One :class:`SessionClient` is one route session (at one epoch) toward one peer
hop. It outlives the streams that carry it: after a transport failure the edge
calls :meth:`SessionClient.stream_lost`, opens a new stream with
:meth:`SessionClient.start_stream`, and every unit that was not answered is sent
again as the very same bytes (same idempotency step, same work id), so the
worker acknowledges an already-applied step as a duplicate instead of applying
it twice.

How it is cut: the client keeps the stream (its negotiation and credit) and decides what
to send; where each unit stands is :class:`~.client_book.UnitBook`'s, what the requests
look like is :mod:`.client_requests`', and what it reports is :mod:`.client_events`.

Edge loop (the :mod:`meshnode.sansio` convention)::

    write(encode_stream_open(StreamType.SHARD_SESSION, bodies[0]) + encode_frame(bodies[1]))
        where bodies = client.start_stream()
    on each frame:      client.receive_frame(body)
    after every call:   for body in client.requests_to_send(now_ns): write(encode_frame(body))
                        for event in client.take_events(): ...
    at client.get_timer(): client.handle_timer(now_ns)
    stream reset/lost:  client.stream_lost(); then start_stream() again, or give up.

Direct answer (the head's client, ``direct_answers=True``): the head also opens an
*answer stream* to the route's tail (:meth:`SessionClient.answer_stream_start`), and
the tail sends the result chunk of every unit it samples a token for there, while the
Acks still come back hop by hop on the work stream, saying ``answered_directly``.
A unit is done at whichever comes first, its result (direct or relayed) or an Ack
with a result; an Ack that says the result went direct, before it arrived, returns
the unit's credit and leaves the unit owed until the answer comes
(:meth:`SessionClient.receive_answer_frame`) or the answer stream is lost
(:meth:`SessionClient.answers_lost`, which fails the owed units). A unit answered
directly is never sent again after a stream loss: every hop has applied it.

``now_ns`` is monotonic nanoseconds. A unit's deadline is a
:class:`~meshnode.dataplane.envelope.Deadline`: the wall-clock instant its envelope
carries, and that instant on the monotonic clock the timers run on.

:meth:`receive_frame` raises :class:`~meshnode.wire.errors.ShardProtocolError`
(PAYLOAD_CORRUPT) when the peer breaks the protocol (garbage, an answer for a
unit never sent): the edge closes that stream and calls :meth:`stream_lost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from meshnode.dataplane.actions import ForwardWork
from meshnode.dataplane.client_book import UnitBook
from meshnode.dataplane.client_events import (
    ClientEvent,
    PeerRefusal,
    SessionFailed,
    SessionReady,
    UnitDone,
    UnitFailed,
)
from meshnode.dataplane.client_requests import (
    SessionAddress,
    answer_stream_opening,
    cancel_request,
    cancel_signal,
    release_request,
    release_signal,
    unit_request,
    work_stream_opening,
)
from meshnode.dataplane.client_units import OutgoingUnit, PrefixBlocks, prefill_pieces
from meshnode.dataplane.envelope import (
    SUPPORTED_SCHEMA_VERSIONS,
    Deadline,
    UnitPosition,
    digests,
    later,
)
from meshnode.dataplane.errors import payload_corrupt, refusal
from meshnode.dataplane.payload import encode_hidden, encode_tokens
from meshnode.dataplane.route import BOUNDARY_DTYPES
from meshnode.dataplane.unit_journal import JournalEntry, UnitJournal
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.chunking import tokens_per_chunk
from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.flow_control import default_flow_control
from meshnode.wire.pb import shard


class SessionNotReady(MeshnodeError):
    """The call needs the negotiated limits, and the session is not accepted yet (or has failed)."""


@dataclass(frozen=True)
class ClientConfig:
    # Limits this sender can honour; None: meshnode.wire.flow_control.default_flow_control().
    proposed_flow_control: shard.FlowControl | None = None
    # Compressions this sender decodes (NONE is always included).
    accepted_compression: tuple[shard.Compression, ...] = (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD)
    # Streams a unit may be sent on before a transport failure fails it.
    max_attempts: int = 3
    # Failed units remembered for retry(), newest kept.
    retry_memory: int = 64
    # A sent unit is given up (SessionTransportError) this long after its deadline, so that the
    # worker's own DEADLINE_EXCEEDED, which it sends at the deadline, can still arrive first.
    answer_grace_ns: int = 0
    # This client opens an answer stream to the tail and waits there for results that Acks say
    # went direct (the session's head); a forwarding hop's client passes such Acks on instead.
    direct_answers: bool = False


class SessionClient:
    def __init__(
        self,
        *,
        route_session_id: str,
        route_epoch: int,
        fingerprint: shard.Fingerprint,
        shard_range: shard.ShardRange,
        route: dataplane.SessionRoute,
        config: ClientConfig | None = None,
        first_step: int = 1,
    ) -> None:
        if first_step < 1:
            raise ValueError("idempotency steps start at 1")
        self.route_session_id = route_session_id
        self.route_epoch = route_epoch
        self.fingerprint = fingerprint
        self.shard_range = shard_range
        self.route = route
        self._address = SessionAddress(route_session_id, route_epoch, fingerprint, shard_range, route)
        self.config = config or ClientConfig()
        self.takes_tokens = shard_range.effective_start_layer == 0
        self.boundary_dtype = route.boundary_dtype or shard.DTYPE_FLOAT32
        if self.boundary_dtype not in BOUNDARY_DTYPES:
            raise ValueError("route boundary dtype must be FLOAT32 or BFLOAT16")
        self.next_step = first_step
        self.flow: shard.FlowControl | None = None
        self.failed: MeshnodeError | None = None
        self._accepted = False
        self._window = 0
        self._unacked = 0
        self._send_compression = shard.COMPRESSION_NONE
        self._events: list[ClientEvent] = []
        self._units = UnitBook(self._events, retry_memory=self.config.retry_memory)
        self._next_unit_id = 1
        # Every unit submitted, for an audit to replay (meshnode.dataplane.unit_journal); None: none.
        self.journal: UnitJournal | None = None

    # ------------------------------------------------------------------ state

    @property
    def accepted(self) -> bool:
        return self._accepted

    @property
    def window(self) -> int:
        """Un-acked units the peer currently allows."""
        return self._window

    @property
    def unacked(self) -> int:
        return self._unacked

    @property
    def pending(self) -> int:
        """Units waiting for credit (or for the session to open)."""
        return self._units.pending

    @property
    def can_send(self) -> bool:
        return self._accepted and self._units.pending > 0 and self._unacked < self._window

    @property
    def outstanding(self) -> int:
        """Units still owed an answer: waiting to be sent, or sent and not given up."""
        return self._units.outstanding

    @property
    def acks_owed(self) -> int:
        """Units done by their direct answer whose Acks are still on their way back along the route
        (a release sent now would cancel them on the hops that have not acknowledged yet)."""
        return self._units.acks_owed

    def take_events(self) -> list[ClientEvent]:
        """Everything that happened since the last call, in order."""
        drained = list(self._events)
        self._events.clear()
        return drained

    # ------------------------------------------------------------------ streams

    def start_stream(self) -> list[bytes]:
        """Bodies of the first two frames of a new stream: the SessionRoute, then SessionOpen."""
        if self.failed is not None:
            raise SessionNotReady("the session failed; open a new one")
        self._accepted = False
        self._window = 0
        self._unacked = 0
        proposed = self.config.proposed_flow_control or default_flow_control()
        return work_stream_opening(self._address, proposed, self.config.accepted_compression)

    def answer_stream_start(self, tail_range: shard.ShardRange) -> list[bytes]:
        """Bodies of the first two frames of the answer stream to the route's tail (``tail_range``):
        an empty route, then a SessionOpen that asks for this session's direct answers."""
        proposed = self.config.proposed_flow_control or default_flow_control()
        return answer_stream_opening(self._address, tail_range, proposed, self.config.accepted_compression)

    def stream_lost(self) -> None:
        """The stream failed before every unit was answered. Unanswered units are queued to be sent
        again as the same bytes on the next stream, or fail with SessionTransportError once they
        have been sent ``max_attempts`` times. Units answered directly are done: not sent again."""
        self._accepted = False
        self._window = 0
        self._unacked = 0
        self._units.stream_lost(self.config.max_attempts)

    # ------------------------------------------------------------------ submitting work

    def submit_prefill(
        self,
        inputs: np.ndarray | Sequence[int],
        *,
        first_position: int = 0,
        deadline: Deadline | None = None,
        blocks: PrefixBlocks | None = None,
        chunk_allowance_ns: int = 0,
    ) -> list[int]:
        """Split a prefill into chunks within the negotiated limits; returns their unit ids.

        ``inputs``: token ids ``[n]`` for a head hop, float32 hidden ``[n, hidden]`` otherwise.
        ``first_position == 0`` starts fresh state; otherwise the cache must hold exactly
        ``first_position`` tokens, or (with ``blocks``) a session may start from the kept prefix
        of that many tokens. ``deadline`` is the first chunk's; each later chunk, which waits for
        the ones before it, has ``chunk_allowance_ns`` more than the one before.
        """
        pieces = prefill_pieces(
            inputs,
            first_position=first_position,
            takes_tokens=self.takes_tokens,
            boundary_dtype=self.boundary_dtype,
            flow=self._require_flow(),
            blocks=blocks,
        )
        return [
            self._add(
                p.position,
                deadline=later(deadline, index * chunk_allowance_ns),
                tokens=p.tokens,
                hidden=p.hidden,
            )
            for index, p in enumerate(pieces)
        ]

    def submit_decode(
        self,
        value: int | np.ndarray,
        *,
        position: int,
        deadline: Deadline | None = None,
        draft: Sequence[int] = (),
        rollback: bool = False,
    ) -> int:
        """One token at ``position`` (the cache must hold ``position`` tokens): a token id for a head
        hop, a float32 hidden ``[1, hidden]`` otherwise. Sent as a DecodeStep.

        Speculative decoding (a head hop only): ``draft`` tokens follow the token in the same
        unit, a verify step whose answer is the tail's choice after every position; ``rollback``
        lets each hop drop the uncommitted drafts of the session's previous verify step down to
        ``position`` first. Either makes it an ActivationChunk (a DecodeStep carries neither)."""
        if draft and not self.takes_tokens:
            raise ValueError("only a head hop takes draft tokens")
        tokens = np.asarray([value, *draft], dtype=np.int32) if self.takes_tokens else None
        hidden = None if self.takes_tokens else np.asarray(value, dtype=np.float32).reshape(1, -1)
        return self._add(
            UnitPosition(
                decode=True,
                first_position=position,
                token_count=1 + len(draft),
                expected_past_len=position,
                draft_tokens=len(draft),
                rollback=rollback,
            ),
            deadline=deadline,
            tokens=tokens,
            hidden=hidden,
        )

    def submit_replay(self, entry: JournalEntry, *, deadline: Deadline | None = None) -> int:
        """Send a unit another session's journal recorded, as it was (an audit's replay)."""
        return self._add(
            entry.position, deadline=deadline, tokens=entry.tokens, hidden=entry.hidden, step=entry.step
        )

    def submit_forward(self, work: ForwardWork) -> int:
        """A unit a forwarding worker passes on, with the step and work id it arrived with."""
        hidden = np.asarray(work.hidden, dtype=np.float32)
        return self._add(
            work.position,
            deadline=work.deadline,
            tokens=None,
            hidden=hidden,
            step=work.step,
            work_id=work.work_id,
            handoff=work.handoff,
        )

    def _add(
        self,
        position: UnitPosition,
        *,
        deadline: Deadline | None,
        tokens: np.ndarray | None,
        hidden: np.ndarray | None,
        step: int | None = None,
        work_id: str | None = None,
        handoff: shard.SignedHandoff | None = None,
    ) -> int:
        if self.failed is not None:
            raise SessionNotReady("the session failed; open a new one")
        if step is None:
            step = self.next_step
        self.next_step = max(self.next_step, step + 1)
        if self.journal is not None:
            self.journal.record(step, position, tokens, hidden)
        unit = OutgoingUnit(
            id=self._next_unit_id,
            step=step,
            work_id=work_id if work_id is not None else f"{self.route_session_id}/{self.route_epoch}/{step}",
            position=position,
            deadline=deadline,
            tokens=tokens,
            hidden=hidden,
            handoff=handoff,
        )
        self._next_unit_id += 1
        self._units.add(unit)
        return unit.id

    def retry(self, unit_id: int) -> None:
        """Send a failed unit again as the same bytes: same idempotency step, same work id.

        For a refusal marked ``retryable`` (or a transport failure): a worker that
        already applied the step answers it as a duplicate instead of applying it twice.
        """
        if self.failed is not None:
            raise SessionNotReady("the session failed; open a new one")
        self._units.retry(unit_id)

    def prefill_chunk_tokens(self) -> int:
        """The most token positions one prefill chunk from the head may carry on this stream."""
        flow = self._require_flow()
        return tokens_per_chunk(
            flow.max_prefill_chunk_tokens, bytes_per_token=4, max_chunk_bytes=flow.max_chunk_bytes
        )

    def _require_flow(self) -> shard.FlowControl:
        if self.failed is not None or self.flow is None:
            raise SessionNotReady("prefill planning needs the limits negotiated at open")
        return self.flow

    # ------------------------------------------------------------------ sending

    def requests_to_send(self, now_ns: int) -> list[bytes]:
        """Bodies of the requests the current credit allows, in order; each moves to in flight.

        ``now_ns`` is when they leave: a unit sent after its deadline still gets the answer grace,
        so the worker's own DEADLINE_EXCEEDED can reach the caller."""
        bodies: list[bytes] = []
        flow = self.flow
        while self._accepted and self._units.pending and self._unacked < self._window:
            assert flow is not None
            unit = self._units.next_to_send()
            if unit.body is None:
                unit.body = self._build(unit).SerializeToString()
            if len(unit.body) > flow.max_chunk_bytes:
                detail = f"unit of {len(unit.body)} bytes over the negotiated max_chunk_bytes"
                self._units.fail(unit, refusal(shard.ERROR_CODE_FLOW_CONTROL_VIOLATION, detail))
                continue
            self._units.sent(unit, now_ns)
            self._unacked += 1
            bodies.append(unit.body)
        return bodies

    def _input_tensor(self, unit: OutgoingUnit) -> shard.NamedTensor:
        if unit.tokens is not None:
            return encode_tokens(unit.tokens)
        assert unit.hidden is not None
        return encode_hidden(unit.hidden, self.boundary_dtype, self._send_compression)

    def _build(self, unit: OutgoingUnit) -> shard.SessionRequest:
        tensor = self._input_tensor(unit)
        # Inputs are encoded into the body; drop the arrays so a retry holds only bytes.
        unit.tokens = unit.hidden = None
        return unit_request(
            self._address,
            step=unit.step,
            work_id=unit.work_id,
            position=unit.position,
            deadline=unit.deadline,
            tensor=tensor,
            handoff=unit.handoff,
        )

    # ------------------------------------------------------------------ signals

    def cancel_signal(self, work_id: str = "", reason: str = "") -> bytes:
        """In-band CancelSignal body (no credit needed). Units not yet sent fail here as CANCELLED;
        sent ones fail when the worker's CANCELLED statuses arrive."""
        self._units.cancel_pending(work_id)
        return cancel_signal(self._address, work_id, reason)

    def cancel_request(self, work_id: str = "", reason: str = "") -> shard.CancelRequest:
        """The unary Cancel for a fresh SHARD_CANCEL stream, for when this stream is wedged."""
        self._units.cancel_pending(work_id)
        return cancel_request(self._address, work_id, reason)

    def release_signal(self, work_id: str = "") -> bytes:
        return release_signal(self._address, work_id)

    def release_request(self) -> shard.ReleaseRequest:
        return release_request(self._address)

    # ------------------------------------------------------------------ receiving

    def receive_answer_frame(self, body: bytes) -> None:
        """One frame from the answer stream: its SessionAccepted, then the tail's direct answers.
        Raises PAYLOAD_CORRUPT for anything else, or an answer naming another session; a
        refusal (the tail would not answer directly) raises it: the edge drops the answer stream
        and calls :meth:`answers_lost`. An answer for no unit owed (a duplicate) is ignored."""
        response = shard.SessionResponse()
        try:
            response.ParseFromString(body)
        except DecodeError:
            raise payload_corrupt("answer frame is not a well-formed message") from None
        kind = response.WhichOneof("kind")
        if kind == "accepted" or kind == "flow_control":
            return
        if kind == "status":
            raise ShardProtocolError.from_pb(response.status.error)
        if kind != "chunk":
            raise payload_corrupt(f"{kind or 'empty response'} on the answer stream")
        envelope = response.chunk.envelope
        if envelope.route_session_id != self.route_session_id or envelope.route_epoch != self.route_epoch:
            raise payload_corrupt("direct answer for another session")
        self._units.direct_answer(envelope.idempotency_step, envelope.work_id, response.chunk.bundle)

    def answers_lost(self) -> None:
        """The answer stream ended: the units owed a direct answer fail (SessionTransportError), as
        does any later Ack that says its result went direct; the tail, seeing the stream gone,
        answers along the route again."""
        self._units.answers_lost()

    def receive_frame(self, body: bytes) -> None:
        response = shard.SessionResponse()
        try:
            response.ParseFromString(body)
        except DecodeError:
            raise payload_corrupt("response frame is not a well-formed message") from None
        self.receive_response(response)

    def receive_response(self, response: shard.SessionResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "accepted":
            self._on_accepted(response.accepted)
        elif not self._accepted and kind != "status":
            raise payload_corrupt(f"{kind or 'empty response'} before SessionAccepted")
        elif kind == "ack":
            self._on_ack(response.ack)
        elif kind == "chunk":
            self._units.result_arrived(response.chunk.envelope.idempotency_step, response.chunk.bundle)
        elif kind == "status":
            self._on_status(response.status)
        elif kind == "flow_control":
            assert self.flow is not None
            self._window = min(
                self._window + response.flow_control.credits_granted, self.flow.max_inflight_chunks
            )
        else:
            raise payload_corrupt("empty response")

    def _on_accepted(self, accepted: shard.SessionAccepted) -> None:
        if self._accepted:
            raise payload_corrupt("second SessionAccepted on one stream")
        mismatch: ShardProtocolError | None = None
        if accepted.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
            mismatch = refusal(
                shard.ERROR_CODE_SCHEMA_UNSUPPORTED, "peer chose an unsupported schema version"
            )
        elif digests(accepted.fingerprint) != digests(self.fingerprint):
            mismatch = refusal(shard.ERROR_CODE_FINGERPRINT_MISMATCH, "peer serves another fingerprint")
        elif accepted.route_session_id != self.route_session_id or accepted.route_epoch != self.route_epoch:
            mismatch = payload_corrupt("peer accepted another session")
        if mismatch is not None:
            self._fail_session(mismatch)
            return
        flow = accepted.flow_control
        self.flow = flow
        self._window = min(flow.credits_granted, flow.max_inflight_chunks)
        self._accepted = True
        route_compression = self.route.compression or shard.COMPRESSION_NONE
        self._send_compression = (
            route_compression
            if route_compression in accepted.accepted_compression
            else shard.COMPRESSION_NONE
        )
        self._events.append(SessionReady(accepted))

    def _on_ack(self, ack: shard.Ack) -> None:
        self._units.acked(ack, waits_for_direct_answers=self.config.direct_answers)
        self._unacked -= 1

    def _on_status(self, status: shard.ShardStatus) -> None:
        error = ShardProtocolError.from_pb(status.error)
        if status.terminal:
            self._fail_session(error)
        elif self._units.refused(status.idempotency_step, error):
            self._unacked -= 1

    # ------------------------------------------------------------------ time

    def handle_timer(self, now_ns: int) -> None:
        """Fail units whose deadline passed without an answer (a wedged or dead peer)."""
        self._units.expire(now_ns, self.config.answer_grace_ns)

    def get_timer(self) -> int | None:
        return self._units.next_deadline(self.config.answer_grace_ns)

    # ------------------------------------------------------------------ failures

    def abandon(self, error: MeshnodeError) -> None:
        """The edge gives up on the session (peer unreachable, closing): every unit not yet answered
        fails with ``error`` and nothing more can be submitted. A no-op on a session already over."""
        if self.failed is None:
            self._fail_session(error)

    def _fail_session(self, error: MeshnodeError) -> None:
        self.failed = error
        self._accepted = False
        self._units.fail_all(error)
        self._events.append(SessionFailed(error))


__all__ = [
    "ClientConfig",
    "ClientEvent",
    "PeerRefusal",
    "SessionClient",
    "SessionFailed",
    "SessionNotReady",
    "SessionReady",
    "UnitDone",
    "UnitFailed",
]
