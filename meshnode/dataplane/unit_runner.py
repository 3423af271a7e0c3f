"""Admitted units on their way through a shard: engine batches, results, forwarding and replay.

:class:`UnitRunner` takes the units the worker admitted and sees each answered exactly once:
it forms engine batches from the queues (:class:`~.batch_former.BatchFormer`), turns each
unit's outcome into its answer (:class:`~.stream_table.StreamTable`) or, on a hop that is not
the tail, into work for the next hop (:class:`~.actions.Forward`), records every applied step
in its session's ledger so that a retry is answered from the record, and abandons units when
their deadline passes, their work is cancelled or their session ends. It owns the units in
flight to the next hop (and the duplicates waiting on them); it never opens, admits or ends a
session, and calls nothing back in the worker.
"""

from __future__ import annotations

from dataclasses import replace

from engines.interface import BatchStep, CancelToken, EngineError, StepResult
from meshnode.audit.commitment import CommitmentSigner, chained_input_digest, hidden_digest, output_digest
from meshnode.audit.handoff import sign_handoff, states_handoffs
from meshnode.dataplane import errors
from meshnode.dataplane.actions import (
    Action,
    CancelDownstream,
    DownstreamResult,
    FireCancel,
    Forward,
    ForwardWork,
)
from meshnode.dataplane.batch_former import BatchFormer
from meshnode.dataplane.cohorts import cohort_limit
from meshnode.dataplane.payload import check_result
from meshnode.dataplane.session_table import SessionTable
from meshnode.dataplane.steps import RecordState, StepRecord, Verdict
from meshnode.dataplane.stream_table import StreamTable
from meshnode.dataplane.unit_steps import (
    cache_refusal,
    downstream_error,
    passed,
    result_bundle,
    result_chunk,
    step_request,
    verdict_refusal,
)
from meshnode.dataplane.worker_state import SessionState, Unit
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard


class UnitRunner:
    def __init__(
        self,
        outbox: list[Action],
        sessions: SessionTable,
        streams: StreamTable,
        batches: BatchFormer,
        signer: CommitmentSigner | None = None,
    ) -> None:
        self._outbox = outbox
        # Signs this hop's commitment for every unit it applies (None: it signs none).
        self._signer = signer
        self._sessions = sessions
        self._streams = streams
        self._batches = batches
        # Units whose step was forwarded, by id, until the next hop answers; and duplicates of a
        # forwarded step that wait for the same answer.
        self._forwarding: dict[int, Unit] = {}
        self._followers: dict[int, Unit] = {}

    def busy_sessions(self) -> set[SessionState]:
        """The sessions with a unit queued, running or forwarded (their idle leases wait)."""
        # Plain loops, no generators: this and next_deadline run after every input (the timer is
        # re-armed then), twice a decode token.
        busy = set(self._batches.ready_sessions())
        for unit in self._batches.running_units():
            busy.add(unit.session)
        for unit in self._forwarding.values():
            busy.add(unit.session)
        return busy

    def next_deadline(self) -> int | None:
        """The earliest deadline of a unit not yet answered (monotonic ns), or None."""
        earliest: int | None = None
        for units in (
            self._batches.queued_units(),
            self._batches.running_units(),
            self._forwarding.values(),
            self._followers.values(),
        ):
            for unit in units:
                deadline = unit.deadline
                if (
                    deadline is not None
                    and not unit.answered
                    and (earliest is None or deadline.at_ns < earliest)
                ):
                    earliest = deadline.at_ns
        return earliest

    # ------------------------------------------------------------------ batches

    def pump(self, now_ns: int) -> None:
        """Start engine batches while the engine is free and units are ready (and no hold is on)."""
        while (
            plan := self._batches.plan(now_ns, cohort_limit(s.plan.pipeline_stages for s in self._sessions))
        ) is not None:
            # A head unit refused before the engine (deadline, replay, cache miss) takes no room;
            # its session's next unit waits for the next batch, whose plan sees what that unit is.
            # Every plan takes at least one unit off a queue, so the pump ends.
            units: list[Unit] = []
            steps: list[BatchStep] = []
            while (unit := self._batches.take(plan)) is not None:
                step = self._prepare(unit, now_ns)
                if step is not None:
                    units.append(unit)
                    steps.append(step)
                self._batches.taken(plan, unit, ran=step is not None)
            run = self._batches.start(units, steps, tokens=plan.tokens, now_ns=now_ns)
            if run is not None:
                self._outbox.append(run)

    def _prepare(self, unit: Unit, now_ns: int) -> BatchStep | None:
        """The engine step for a unit leaving its queue, or None when it was answered instead."""
        session = unit.session
        if passed(unit.deadline, now_ns):
            self._streams.fail(unit, errors.deadline_exceeded())
            return None
        position = unit.position
        verdict, record = session.ledger.judge(unit.step, unit.work_id, fresh_start=position.fresh_start)
        if verdict is Verdict.REPLAY:
            assert record is not None
            self.replay(unit, record)
            return None
        if verdict is not Verdict.ADMIT:
            self._streams.fail(unit, verdict_refusal(verdict, session))
            return None
        refusal = cache_refusal(session, position)
        if refusal is not None:
            self._streams.fail(unit, refusal)
            return None
        # A token per unit, so that cancelling one unit leaves the rest of its batch running.
        token = CancelToken()
        try:
            request = step_request(unit, token)
        except EngineError as error:
            self._streams.fail(unit, errors.from_engine_failure(error))
            return None
        unit.token = token
        unit.input = None
        if self._signer is not None:
            previous = session.audit_chain
            if position.fresh_start or previous is not None:
                unit.input_digest = chained_input_digest(None if position.fresh_start else previous, request)
        # A verify step runs through the engine's multi-token (prefill) path, alone.
        return BatchStep(request, position.single_decode)

    def batch_finished(self, batch_id: int, outcomes: object, now_ns: int) -> None:
        """See :meth:`~.worker.ShardWorker.batch_finished`."""
        batch = self._batches.finish(batch_id, now_ns)
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
            self._unit_finished(unit, outcome, now_ns)
            session = unit.session
            if self._sessions.holds(session) and not session.queue:
                self._batches.answered(session, now_ns)
        # Results are answered or forwarded above; the next batch starts now, without waiting for
        # the next hop (its answers arrive through downstream_finished).
        self.pump(now_ns)

    def _unit_finished(self, unit: Unit, outcome: object, now_ns: int) -> None:
        session = unit.session
        live = self._sessions.holds(session)
        if live:
            session.last_active_ns = now_ns
        if isinstance(outcome, BaseException):
            error = errors.from_engine_failure(outcome)
            # What the engine holds after a failure is not known: no commitment until a fresh start.
            session.audit_chain = None
            if live:
                is_miss = error.code == shard.ERROR_CODE_CACHE_MISS
                session.past_len = error.actual_past_len if is_miss else None
                # How much of what the engine holds is committed is not known after a refusal.
                session.committed_len = None
            self._streams.fail(unit, error)
            return
        try:
            result = check_result(
                outcome,
                session.role,
                unit.position.token_count,
                sampled=unit.position.final and session.role.is_tail,
                want_logits=session.plan.return_logits,
                verify=unit.position.verify,
            )
        except ShardProtocolError as error:
            session.audit_chain = None
            if live:
                session.past_len = session.committed_len = None
            self._streams.fail(unit, error)
        else:
            if live:
                self._applied(unit, result)

    def _applied(self, unit: Unit, result: StepResult) -> None:
        session = unit.session
        session.past_len = result.past_len
        session.committed_len = result.past_len - unit.position.draft_tokens
        cache = shard.CacheResult(
            mode=shard.CACHE_MODE_PREFILL if unit.position.fresh_start else shard.CACHE_MODE_DECODE,
            past_len=result.past_len,
            cache_hit=result.cache_hit,
        )
        plan = session.plan
        forwards = plan.next_hop is not None
        # A forwarding hop's output is the hidden states it passes on, digested once for both
        # statements: what it computed (commitment) and what it sent (handoff).
        signs = self._signer is not None
        sent = hidden_digest(result.hidden) if signs and forwards and result.hidden is not None else None
        own = self._commit(unit, result, sent)
        commitments = () if own is None else (own,)
        if not forwards:
            stream = self._streams.get(unit.stream_id)
            compression = stream.result_compression if stream is not None else shard.COMPRESSION_NONE
            bundle = result_bundle(unit, result, compression)
            record = StepRecord(
                unit.step,
                unit.work_id,
                cache,
                result.execution_nanos,
                RecordState.COMPLETE,
                result=None if bundle is None else result_chunk(unit, bundle),
                own_commitment=own,
                commitments=commitments,
            )
            session.ledger.applied(record)
            self._streams.succeed(unit, record, duplicate=False)
            return
        assert result.hidden is not None and plan.onward is not None
        work = ForwardWork(
            step=unit.step,
            work_id=unit.work_id,
            position=unit.position,
            deadline=unit.deadline,
            hidden=result.hidden,
            handoff=self._handoff(unit, sent),
        )
        record = StepRecord(
            unit.step,
            unit.work_id,
            cache,
            result.execution_nanos,
            RecordState.FORWARDING,
            forward=work,
            own_commitment=own,
            commitments=commitments,
        )
        session.ledger.applied(record)
        if unit.answered:
            # Nobody waits for it (deadline, cancel); a retry of the step re-forwards it.
            record.state = RecordState.FORWARD_FAILED
            return
        self._forward(unit, record, work)

    def _commit(self, unit: Unit, result: StepResult, sent: bytes | None) -> shard.SignedCommitment | None:
        """Sign this hop's commitment for an applied unit, moving the session's chain on;
        ``sent``: the digest of the hidden states a forwarding hop passes on (its output)."""
        if self._signer is None or unit.input_digest is None:
            return None
        session = unit.session
        session.audit_chain = unit.input_digest
        return self._signer.sign(
            shard_range=session.shard_range,
            session_id=session.session_id,
            epoch=session.epoch,
            step=unit.step,
            work_id=unit.work_id,
            first_position=unit.position.first_position,
            token_count=unit.position.token_count,
            input_digest=unit.input_digest,
            output=output_digest(result) if sent is None else sent,
            input_handoff=unit.input_handoff,
        )

    def _handoff(self, unit: Unit, sent: bytes | None) -> shard.SignedHandoff | None:
        """This hop's signed statement of what it sends on in ``unit`` (once per unit, however
        many positions it holds), where the route's boundary dtype carries what it computed. Made
        with every unit, committed or not (after an engine failure no commitment is made until a
        fresh start): the next hop refuses a unit without one once one came (handoff_check)."""
        session = unit.session
        if self._signer is None or sent is None or not states_handoffs(session.role.boundary_dtype):
            return None
        return sign_handoff(
            self._signer.identity,
            session_id=session.session_id,
            epoch=session.epoch,
            step=unit.step,
            work_id=unit.work_id,
            sent_digest=sent,
        )

    # ------------------------------------------------------------------ the next hop and replays

    def _forward(self, unit: Unit, record: StepRecord, work: ForwardWork) -> None:
        plan = unit.session.plan
        assert plan.next_hop is not None and plan.onward is not None
        record.state = RecordState.FORWARDING
        unit.record = record
        self._forwarding[unit.id] = unit
        self._outbox.append(Forward(unit.id, unit.session.key, plan.next_hop, plan.onward, work))

    def replay(self, unit: Unit, record: StepRecord) -> None:
        """Answer a step that was already applied here, without applying it again."""
        unit.replay = True
        unit.input = None
        if record.state is RecordState.COMPLETE:
            self._streams.succeed(unit, record, duplicate=True)
        elif record.state is RecordState.FORWARDING:
            record.followers.append(unit)
            self._followers[unit.id] = unit
        else:
            work = replace(record.forward, deadline=unit.deadline)
            record.forward = work
            self._forward(unit, record, work)

    def downstream_finished(self, unit_id: int, outcome: object, now_ns: int) -> None:
        """See :meth:`~.worker.ShardWorker.downstream_finished`."""
        unit = self._forwarding.pop(unit_id)
        record = unit.record
        assert record is not None
        waiting = [unit, *record.followers]
        for follower in record.followers:
            self._followers.pop(follower.id, None)
        record.followers.clear()
        if isinstance(outcome, DownstreamResult):
            record.state = RecordState.COMPLETE
            record.forward = None
            record.answered_directly = outcome.answered_directly
            # Passed on unchecked (the head checks them), but no more than the hops after this one.
            onward = len(unit.session.plan.message.downstream)
            own = () if record.own_commitment is None else (record.own_commitment,)
            record.commitments = (*own, *outcome.commitments[:onward])
            if outcome.bundle is not None:
                record.result = result_chunk(unit, outcome.bundle)
            for waiter in waiting:
                self._streams.succeed(waiter, record, duplicate=waiter.replay)
        else:
            record.state = RecordState.FORWARD_FAILED
            error = downstream_error(outcome)
            for waiter in waiting:
                self._streams.fail(waiter, error)
        unit.session.ledger.trim()
        if self._sessions.holds(unit.session):
            unit.session.last_active_ns = now_ns
        self.pump(now_ns)

    # ------------------------------------------------------------------ giving units up

    def expire(self, now_ns: int) -> None:
        """Fail every unit not yet answered whose deadline has passed at ``now_ns``."""
        for running in self._batches.running_units():
            if not running.answered and passed(running.deadline, now_ns):
                # Only this unit's token: the others in its batch run on.
                assert running.token is not None
                self._outbox.append(FireCancel(running.id, running.token))
                self._streams.fail(running, errors.deadline_exceeded())
        for session in self._batches.ready_sessions():
            late = [u for u in session.queue if passed(u.deadline, now_ns)]
            if late:
                self._batches.unqueue(session, late)
                for unit in late:
                    self._streams.fail(unit, errors.deadline_exceeded())
        for unit in [*self._forwarding.values(), *self._followers.values()]:
            if not unit.answered and passed(unit.deadline, now_ns):
                self._streams.fail(unit, errors.deadline_exceeded())
        for follower_id in [i for i, u in self._followers.items() if u.answered]:
            del self._followers[follower_id]

    def cancel(self, session: SessionState, work_id: str, error: ShardProtocolError) -> int:
        """Fail ``session``'s units not yet answered (only ``work_id``'s if given) with ``error``:
        running ones get their cancel token fired, queued ones leave their queue, and the next
        hop is told when forwarded ones were among them. Returns how many."""

        def matches(unit: Unit) -> bool:
            return not unit.answered and (not work_id or unit.work_id == work_id)

        count = 0
        for running in self._batches.running_units():
            if running.session is session and matches(running):
                # This unit's token only: the other sessions' units in the batch are not touched.
                assert running.token is not None
                self._outbox.append(FireCancel(running.id, running.token))
                self._streams.fail(running, error)
                count += 1
        queued = [u for u in session.queue if matches(u)]
        if queued:
            self._batches.unqueue(session, queued)
            for unit in queued:
                self._streams.fail(unit, error)
            count += len(queued)
        forwarded = [u for u in self._forwarding.values() if u.session is session and matches(u)]
        followers = [u for u in self._followers.values() if u.session is session and matches(u)]
        for unit in [*forwarded, *followers]:
            self._streams.fail(unit, error)
        count += len(forwarded) + len(followers)
        if forwarded:
            self._outbox.append(CancelDownstream(session.key, work_id))
        return count


__all__ = ["UnitRunner"]
