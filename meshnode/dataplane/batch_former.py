"""Units waiting for a shard's engine, and the batches formed from them (pure bookkeeping).

:class:`BatchFormer` owns the sessions' queues' place in line: which sessions have units
ready (filed with the fair :class:`~.batching.BatchScheduler`), how many units wait in all,
the one batch the engine is computing, and the *hold*: while the engine is free it may wait
a little for sessions the :class:`~.arrival_forecast.ArrivalForecast` says are due back, so
that they share the next batch instead of taking turns. It answers and sends nothing: the
worker forms a batch by asking it for a plan, taking units off it one by one (a unit refused
before the engine takes no room), and starting what it kept::

    plan = former.plan(now_ns, cohort)
    while (unit := former.take(plan)) is not None:
        former.taken(plan, unit, ran=...)
    run = former.start(units, steps, now_ns)
"""

from __future__ import annotations

from collections import deque

from engines.interface import BatchStep
from meshnode.dataplane.actions import RunBatch
from meshnode.dataplane.arrival_forecast import ArrivalForecast
from meshnode.dataplane.batch_stats import BatchStats
from meshnode.dataplane.batching import BatchLimits, BatchPlan, BatchScheduler
from meshnode.dataplane.worker_state import RunningBatch, SessionState, Unit


class BatchFormer:
    def __init__(self, limits: BatchLimits, *, hold_share: float, max_hold_ns: int) -> None:
        self.limits = limits
        self.stats = BatchStats()
        self._hold_share = hold_share
        self._max_hold_ns = max_hold_ns
        # Sessions with queued units; the scheduler holds their turns.
        self._ready: dict[str, SessionState] = {}
        self._scheduler = BatchScheduler(limits)
        self._forecast = ArrivalForecast()
        # While the free engine waits for sessions due back: until when (monotonic ns).
        self._hold_until_ns: int | None = None
        self._last_batch_ns = 0
        self._queued = 0
        # The batch the engine is computing; one at a time, since each session's next unit
        # continues the cache its unit in this batch leaves.
        self._running: RunningBatch | None = None
        self._next_batch_id = 1

    @property
    def queued(self) -> int:
        """Units waiting for the engine, all sessions together."""
        return self._queued

    @property
    def hold_until_ns(self) -> int | None:
        return self._hold_until_ns

    def running_units(self) -> list[Unit]:
        return self._running.units if self._running is not None else []

    def queued_units(self) -> list[Unit]:
        return [u for s in self._ready.values() for u in s.queue]

    def ready_sessions(self) -> list[SessionState]:
        return list(self._ready.values())

    # ------------------------------------------------------------------ queues

    def enqueue(self, unit: Unit, now_ns: int) -> None:
        session = unit.session
        unit.arrived_ns = now_ns
        self._forecast.arrived(session.session_id, now_ns)
        session.queue.append(unit)
        self._queued += 1
        if len(session.queue) == 1:
            self._refile(session)

    def unqueue(self, session: SessionState, units: list[Unit]) -> None:
        """Take ``units`` (never answered, never run) out of ``session``'s queue."""
        gone = {u.id for u in units}
        head = session.queue[0] if session.queue else None
        session.queue = deque(u for u in session.queue if u.id not in gone)
        self._queued -= len(gone)
        if not session.queue or session.queue[0] is not head:
            self._refile(session)

    def forget(self, session: SessionState) -> None:
        """``session`` ended: its queue (already answered) and its rhythm go."""
        self._forecast.forget(session.session_id)
        self._queued -= len(session.queue)
        session.queue.clear()
        self._refile(session)

    def answered(self, session: SessionState, now_ns: int) -> None:
        """``session``'s last unit was answered at ``now_ns``: the forecast times its return."""
        self._forecast.answered(session.session_id, now_ns)

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

    # ------------------------------------------------------------------ forming a batch

    def plan(self, now_ns: int, cohort: int | None) -> BatchPlan | None:
        """The next batch's plan when the engine is free, units are ready and no hold is on;
        ``cohort``: a pipeline cohort's size when the sessions held ask for cohorts."""
        if self._running is not None or not self._ready or self._holding(now_ns, cohort):
            return None
        limit = self.limits.max_units
        return self._scheduler.plan(max_units=limit if cohort is None else min(limit, cohort))

    def take(self, plan: BatchPlan) -> Unit | None:
        """The next unit the plan picks, off its queue; None when the batch is full or nobody is left."""
        session_id = plan.next()
        if session_id is None:
            return None
        unit = self._ready[session_id].queue.popleft()
        self._queued -= 1
        return unit

    def taken(self, plan: BatchPlan, unit: Unit, *, ran: bool) -> None:
        """``unit`` from :meth:`take` joins the batch (``ran``) or was answered before the engine
        and takes no room; its session's next unit is filed either way."""
        if ran:
            plan.accept(unit.session.session_id)
        self._refile(unit.session)

    def start(
        self, units: list[Unit], steps: list[BatchStep], *, tokens: int, now_ns: int
    ) -> RunBatch | None:
        """The engine batch of ``units`` (their ``steps``), now running; None when none was kept."""
        if not units:
            return None
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._running = RunningBatch(batch_id, units)
        decodes = sum(1 for step in steps if step.decode)
        self.stats.started(
            decodes=decodes,
            prefills=len(steps) - decodes,
            tokens=tokens,
            waits_ns=[now_ns - unit.arrived_ns for unit in units],
            now_ns=now_ns,
            ranges=[unit.session.shard_range for unit in units],
        )
        return RunBatch(batch_id, tuple(u.id for u in units), tuple(steps))

    def finish(self, batch_id: int, now_ns: int) -> RunningBatch:
        """The engine is done with ``batch_id``; KeyError when it is not the one running."""
        batch = self._running
        if batch is None or batch.id != batch_id:
            raise KeyError(f"batch {batch_id} is not running")
        self._running = None
        if self.stats.running_since_ns is not None:
            self._last_batch_ns = max(0, now_ns - self.stats.running_since_ns)
        self.stats.finished(now_ns)
        return batch

    def _holding(self, now_ns: int, cohort: int | None) -> bool:
        """Whether the free engine waits for sessions due back within about one batch, so that
        they share the next batch instead of taking turns; each wait has one end, fixed when it
        begins. Never while pipeline cohorts are in force: they move on as they come, and
        waiting for the sessions due back would gather them into one convoy again
        (meshnode.dataplane.cohorts)."""
        if cohort is not None:
            self._hold_until_ns = None
            return False
        horizon = self._hold_horizon()
        if self._hold_until_ns is not None:
            if now_ns < self._hold_until_ns and self._forecast.due_within(self._ready, now_ns, horizon):
                return True
            self._hold_until_ns = None
            return False
        if len(self._ready) >= self.limits.max_units:
            return False
        due = self._forecast.due_within(self._ready, now_ns, horizon)
        if due is None or due <= now_ns:
            return False
        self._hold_until_ns = due
        return True

    def _hold_horizon(self) -> int:
        share = self._hold_share
        return min(round(self._last_batch_ns * share), self._max_hold_ns) if share > 0 else 0


__all__ = ["BatchFormer"]
