"""Where each of a session sender's units stands: waiting, in flight, owed a direct answer, failed.

:class:`UnitBook` owns the units of one :class:`~meshnode.dataplane.client.SessionClient`
and the rules that move them: a unit waits for credit, is sent, and is done at whichever comes
first, its result with an Ack or its direct answer (an Ack that says the answer went direct
leaves it owed until the answer comes). It fails on a refusal, at its deadline (plus the answer
grace), after ``max_attempts`` streams lost under it, or with its session; a failed unit that
was sent is remembered for a retry as the same bytes. Every outcome is an event on the
client's list. The client keeps the stream, its credit and the negotiation; it asks the book,
and the book never calls back.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from meshnode.dataplane.client_events import ClientEvent, PeerRefusal, UnitCommitted, UnitDone, UnitFailed
from meshnode.dataplane.client_units import OutgoingUnit, UnitState
from meshnode.dataplane.errors import SessionTransportError, payload_corrupt, refusal
from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.pb import shard


class UnitBook:
    def __init__(self, events: list[ClientEvent], *, retry_memory: int) -> None:
        self._events = events
        self._retry_memory = retry_memory
        self._pending: deque[OutgoingUnit] = deque()
        # In flight, by idempotency step.
        self._sent: dict[int, OutgoingUnit] = {}
        # Failed after being built, remembered for retry() (newest kept).
        self._failed: OrderedDict[int, OutgoingUnit] = OrderedDict()
        # Units whose Ack said the result went to the answer stream, until it arrives (by step).
        self._owed: dict[int, tuple[OutgoingUnit, shard.Ack]] = {}
        self._answers_lost = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def outstanding(self) -> int:
        sent = sum(1 for u in self._sent.values() if u.state is UnitState.SENT)
        return len(self._pending) + sent + len(self._owed)

    @property
    def acks_owed(self) -> int:
        return sum(1 for u in self._sent.values() if u.state is UnitState.ANSWERED)

    # ------------------------------------------------------------------ waiting and sending

    def add(self, unit: OutgoingUnit) -> None:
        self._pending.append(unit)

    def retry(self, unit_id: int) -> None:
        unit = self._failed.pop(unit_id, None)
        if unit is None:
            raise KeyError(f"unit {unit_id} has not failed, or was forgotten")
        unit.state = UnitState.PENDING
        unit.result = None
        unit.attempts = 0
        self._pending.append(unit)

    def next_to_send(self) -> OutgoingUnit:
        return self._pending.popleft()

    def sent(self, unit: OutgoingUnit, now_ns: int) -> None:
        unit.state = UnitState.SENT
        unit.sent_ns = now_ns
        unit.attempts += 1
        self._sent[unit.step] = unit

    def stream_lost(self, max_attempts: int) -> None:
        """Units in flight wait to be sent again first, in step order, or fail once sent
        ``max_attempts`` times; units answered directly (or abandoned) are not sent again."""
        retry: list[OutgoingUnit] = []
        for unit in sorted(self._sent.values(), key=lambda u: u.step):
            if unit.state is UnitState.ABANDONED or unit.state is UnitState.ANSWERED:
                continue
            if unit.attempts >= max_attempts:
                error = SessionTransportError(f"stream lost; unit was sent {unit.attempts} times unanswered")
                self.fail(unit, error)
                continue
            unit.state = UnitState.PENDING
            retry.append(unit)
        self._sent.clear()
        self._pending.extendleft(reversed(retry))

    def cancel_pending(self, work_id: str) -> None:
        """Units not yet sent (only ``work_id``'s if given) fail as CANCELLED."""
        keep: deque[OutgoingUnit] = deque()
        for unit in self._pending:
            if not work_id or unit.work_id == work_id:
                self.fail(unit, refusal(shard.ERROR_CODE_CANCELLED, "cancelled before it was sent"))
            else:
                keep.append(unit)
        self._pending = keep

    # ------------------------------------------------------------------ answers

    def result_arrived(self, step: int, bundle: shard.TensorBundle) -> None:
        unit = self._sent.get(step)
        if unit is None:
            raise payload_corrupt("result chunk for a unit not in flight")
        unit.result = bundle

    def acked(self, ack: shard.Ack, *, waits_for_direct_answers: bool) -> None:
        """``ack`` answers a unit in flight (PAYLOAD_CORRUPT when none); its credit is back."""
        unit = self._sent.pop(ack.idempotency_step, None)
        if unit is None:
            raise payload_corrupt("ack for a unit not in flight")
        if unit.state is UnitState.ABANDONED or unit.state is UnitState.ANSWERED:
            if unit.state is UnitState.ANSWERED and ack.commitments:
                self._events.append(UnitCommitted(unit.step, unit.work_id, tuple(ack.commitments)))
            return
        if ack.answered_directly and unit.result is None and waits_for_direct_answers:
            if self._answers_lost:
                self.fail(unit, SessionTransportError("the tail answered on a lost answer stream"))
            else:
                self._owed[unit.step] = (unit, ack)
            return
        self.done(unit, unit.result, ack, answered_directly=ack.answered_directly)

    def refused(self, step: int, error: ShardProtocolError) -> bool:
        """A non-terminal status for ``step`` (0: for no unit, a PeerRefusal); True when it took a
        unit's credit back. PAYLOAD_CORRUPT for a step not in flight."""
        unit = self._sent.pop(step, None) if step else None
        if unit is None:
            if step:
                raise payload_corrupt("status for a unit not in flight")
            self._events.append(PeerRefusal(error))
            return False
        # A unit answered directly is done whatever befell the Acks behind it.
        if unit.state is UnitState.SENT:
            self.fail(unit, error)
        return True

    def direct_answer(self, step: int, work_id: str, bundle: shard.TensorBundle) -> None:
        owed = self._owed.pop(step, None)
        if owed is not None:
            unit, ack = owed
            if unit.work_id == work_id:
                self.done(unit, bundle, ack, answered_directly=True)
            else:
                self._owed[step] = owed
            return
        sent = self._sent.get(step)
        if sent is not None and sent.state is UnitState.SENT and sent.work_id == work_id:
            # Ahead of its Ack, as it usually is: done now; the Ack only returns the credit.
            sent.state = UnitState.ANSWERED
            self.done(sent, bundle, shard.Ack(), answered_directly=True)
            return
        for unit in self._pending:
            if unit.step == step and unit.work_id == work_id:
                # Waiting to go out again after a stream loss, yet every hop has applied it.
                self._pending.remove(unit)
                self.done(unit, bundle, shard.Ack(), answered_directly=True)
                return

    def answers_lost(self) -> None:
        self._answers_lost = True
        owed, self._owed = list(self._owed.values()), {}
        for unit, _ack in owed:
            self.fail(unit, SessionTransportError("the tail's direct answer was lost"))

    # ------------------------------------------------------------------ time and endings

    def expire(self, now_ns: int, grace_ns: int) -> None:
        """Fail the units whose deadline passed unanswered: those not sent at once, those sent or
        owed once the answer grace is over too."""
        late = [u for u in self._pending if u.deadline is not None and now_ns >= u.deadline.at_ns]
        if late:
            self._pending = deque(u for u in self._pending if u not in late)
            for unit in late:
                self.fail(unit, refusal(shard.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed before sending"))
        for step, (unit, _ack) in list(self._owed.items()):
            if unit.deadline is not None and now_ns >= unit.given_up_at(grace_ns):
                del self._owed[step]
                self.fail(unit, SessionTransportError("no direct answer by the deadline"))
        for unit in self._sent.values():
            if (
                unit.state is UnitState.SENT
                and unit.deadline is not None
                and now_ns >= unit.given_up_at(grace_ns)
            ):
                unit.state = UnitState.ABANDONED
                error = SessionTransportError("no answer by the deadline")
                self._events.append(UnitFailed(unit.id, unit.step, unit.work_id, error))

    def next_deadline(self, grace_ns: int) -> int | None:
        # Plain loops, no generators or lists: the session's timer is read again twice a token.
        earliest: int | None = None
        for unit in self._pending:
            if unit.deadline is not None and (earliest is None or unit.deadline.at_ns < earliest):
                earliest = unit.deadline.at_ns
        for unit in self._sent.values():
            if unit.deadline is not None and unit.state is UnitState.SENT:
                at_ns = unit.given_up_at(grace_ns)
                if earliest is None or at_ns < earliest:
                    earliest = at_ns
        for unit, _ack in self._owed.values():
            if unit.deadline is not None:
                at_ns = unit.given_up_at(grace_ns)
                if earliest is None or at_ns < earliest:
                    earliest = at_ns
        return earliest

    def done(
        self,
        unit: OutgoingUnit,
        bundle: shard.TensorBundle | None,
        ack: shard.Ack,
        *,
        answered_directly: bool,
    ) -> None:
        self._events.append(
            UnitDone(
                unit_id=unit.id,
                step=unit.step,
                work_id=unit.work_id,
                bundle=bundle,
                cache_result=ack.cache_result,
                duplicate=ack.duplicate,
                execution_nanos=ack.execution_nanos,
                answered_directly=answered_directly,
                commitments=tuple(ack.commitments),
            )
        )

    def fail(self, unit: OutgoingUnit, error: MeshnodeError) -> None:
        self._events.append(UnitFailed(unit.id, unit.step, unit.work_id, error))
        if unit.body is not None:
            self._failed[unit.id] = unit
            while len(self._failed) > self._retry_memory:
                self._failed.popitem(last=False)

    def fail_all(self, error: MeshnodeError) -> None:
        """The session is over: every unit not yet answered fails with ``error``."""
        owed = [unit for unit, _ack in self._owed.values()]
        for unit in [*sorted(self._sent.values(), key=lambda u: u.step), *owed, *self._pending]:
            if unit.state is not UnitState.ABANDONED and unit.state is not UnitState.ANSWERED:
                self.fail(unit, error)
        self._sent.clear()
        self._owed.clear()
        self._pending.clear()


__all__ = ["UnitBook"]
