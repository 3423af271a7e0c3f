"""The ShardEngine contract implemented once, over a backend that only runs layers.

``SessionedEngine`` owns everything the fake and the llama.cpp engine must do alike:
input validation, epochs, cache expectations (``CACHE_MISS`` with the actual length),
cancellation (per step and per session), TTL and LRU eviction, metrics, and tail-side
sampling. A backend implements four hooks: load, forward, truncate and close, and may
implement a fifth, ``_forward_batch``, to compute several sessions' decodes together.

Speculative decoding: a verify step (``draft_tokens > 0``) computes every position exactly as
a decode there would (``_forward_verify``: one token at a time here; the llama.cpp backend runs
several rows in one pass where its kernels round each row as a one-token decode does,
engines.row_invariance), and at a tail samples after every one, as a decode there would
(greedy or seeded: ``interface.supports_speculation``). Its drafts stay
uncommitted (``Session.committed_len``) until a later step's ``rollback`` drops the
rejected ones by ``_truncate``, under the same lock as the step.

Batches (``step_batch``): the decode steps are admitted in order under the same rules as
alone, then computed together per start layer (one ``_forward_batch`` each), then the
prefill chunks run one by one exactly as ``prefill`` runs them; each step's outcome is what
it would have been run alone in that order (decodes first, which the one-after-another
default could equally have done: steps of distinct sessions do not depend on each other).
Prefills stay alone because a prefill chunk is the step worth aborting, and aborting a
shared forward pass would abort every session in it. So nothing polls a shared pass: a
cancel that lands while it computes (the step's token, or its session) makes that step
alone CANCELLED once the pass returns, its computed position rolled back.

Prefix cache (``LoadRequest.prefix_cache_entries``, engines.session_table): a prefill chunk that
carries a block digest and starts where the session's recorded blocks end extends them; a
release keeps those blocks in the session's slot (cut to the last one) instead of emptying it.
A session's first step at position L > 0 naming a digest (``StepRequest.prefix_digest``) opens
from the kept prefix of L positions with that digest, adopting its slot or copying it
(``_copy_prefix``), or is a ``CACHE_MISS`` at length 0. Only prefill-written whole blocks are
ever kept: a decode or verify step computes its rows in passes a fresh prefill does not, so
reusing them would not give the fresh prefill's numbers.

Threads: steps, release, health and metrics run on the caller's worker thread and hold
``_compute_lock``; ``cancel`` and ``CancelToken.cancel`` may come from any thread. A
cancel flags the session at once; its cache is freed immediately when no step is
running, otherwise by the running step when it returns.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from engines.interface import (
    METRIC_CACHE_MISSES,
    METRIC_DECODE_STEPS,
    METRIC_ERRORS,
    METRIC_PREFILL_STEPS,
    METRIC_PREFIX_ENTRIES,
    METRIC_PREFIX_EVICTED,
    METRIC_PREFIX_HITS,
    METRIC_PREFIX_KEPT,
    METRIC_PREFIX_MISSES,
    METRIC_PREFIX_TOKENS_REUSED,
    METRIC_SESSIONS_CANCELLED,
    METRIC_SESSIONS_EVICTED,
    METRIC_SESSIONS_EXPIRED,
    METRIC_SESSIONS_OPENED,
    METRIC_SESSIONS_RELEASED,
    METRIC_STEPS_CANCELLED,
    METRIC_TOKENS_PROCESSED,
    BatchStep,
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    EngineMetrics,
    GrammarState,
    LoadRequest,
    SessionKey,
    ShardEngine,
    StepOutcome,
    StepRequest,
    StepResult,
    rollback_refusal,
    supports_speculation,
)
from engines.sampling import sample_token, validate_sampling
from engines.session_table import PrefixStart, Session, SessionTable

if TYPE_CHECKING:
    import llama_cpp


_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardOutput:
    # Non-tail: float32 [n_tokens, hidden_size].
    hidden: np.ndarray | None = None
    # Tail, when logits were asked for: the last position's logits (may be a view); for a verify
    # step (``_forward_verify``) every position's, [n_tokens, vocab].
    logits: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One session's admitted decode within a ``_forward_batch``."""

    session: Session
    first_position: int
    # int32 token ids or float32 [1, hidden], validated.
    inputs: np.ndarray
    want_logits: bool
    should_abort: Callable[[], bool]


@dataclass(slots=True)
class _AdmittedDecode:
    index: int
    request: StepRequest
    entry: BatchEntry


class SessionedEngine(ShardEngine):
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._caps: EngineCapabilities | None = None
        self._table: SessionTable | None = None
        self._max_context = 0
        self._counters: Counter[str] = Counter()
        self._compute_lock = threading.Lock()
        # Guards the table and the running-step fields against a concurrent cancel.
        self._state_lock = threading.Lock()
        # The sessions whose step is computing, and those of them cancelled meanwhile.
        self._running: set[SessionKey] = set()
        self._cancelled_running: set[SessionKey] = set()
        self._pending_drops: list[Session] = []

    # --- backend hooks ---

    @abstractmethod
    def _load_backend(self, request: LoadRequest) -> tuple[EngineCapabilities, int]:
        """Load the range; return the capabilities and the per-session context limit."""

    @abstractmethod
    def _forward(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        """Run ``inputs`` (int32 token ids, or float32 [n, hidden]) from ``session.start_layer``.

        On an exception the session's backend state must be back at ``first_position``.
        """

    def _forward_batch(self, entries: Sequence[BatchEntry]) -> list[ForwardOutput | EngineError]:
        """Run one-token decodes of distinct sessions that all start at the same layer, each
        with exactly the result it would get alone; an entry's refusal is its own.

        The default runs them one after another through ``_forward``. An override that
        computes them together must leave every entry whose outcome is an EngineError back
        at its ``first_position``, and may not poll ``should_abort`` (one entry's cancel must
        not abort the others). An exception that is not an EngineError fails the batch.
        """
        outputs: list[ForwardOutput | EngineError] = []
        for index, entry in enumerate(entries):
            try:
                output = self._forward(
                    entry.session, entry.first_position, entry.inputs, entry.want_logits, entry.should_abort
                )
            except EngineError as error:
                outputs.append(error)
                continue
            if output.logits is not None and index + 1 < len(entries):
                # A backend's logits may be a view of a buffer the next forward overwrites.
                output = ForwardOutput(output.hidden, np.array(output.logits, dtype=np.float32, copy=True))
            outputs.append(output)
        return outputs

    @abstractmethod
    def _truncate(self, session: Session, length: int) -> None:
        """Drop the session's cached positions >= ``length`` (0: all of them)."""

    def _copy_prefix(self, source: Session, target: Session, length: int) -> None:
        """Make ``target``'s empty slot hold ``source``'s first ``length`` positions, leaving
        ``source`` as it is (prefix cache: a kept prefix longer than the new session needs)."""
        raise EngineError(EngineErrorKind.INTERNAL, "this engine cannot copy a kept prefix")

    @abstractmethod
    def _close_backend(self) -> None: ...

    def _resident_bytes(self) -> int:
        return 0

    # --- ShardEngine ---

    def load(self, request: LoadRequest) -> EngineCapabilities:
        if request.n_seq_max < 1 or request.n_ctx < 1 or request.n_batch < 1:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST, "n_ctx, n_seq_max and n_batch must be positive"
            )
        with self._compute_lock:
            if self._caps is not None:
                raise EngineError(EngineErrorKind.INVALID_REQUEST, "engine is already loaded; close it first")
            caps, max_context = self._load_backend(request)
            with self._state_lock:
                self._caps = caps
                self._max_context = max_context
                self._table = SessionTable(
                    request.n_seq_max,
                    request.session_ttl_s,
                    prefix_entries=request.prefix_cache_entries,
                    prefix_ttl_s=request.prefix_cache_ttl_s,
                )
            return caps

    def capabilities(self) -> EngineCapabilities:
        return self._loaded()[0]

    def prefill(self, request: StepRequest) -> StepResult:
        return self._step(request, decode=False)

    def decode(self, request: StepRequest) -> StepResult:
        return self._step(request, decode=True)

    def cancel(self, session: SessionKey) -> int:
        with self._state_lock:
            if self._table is None:
                return 0
            running = session in self._running
            if running:
                self._cancelled_running.add(session)
            dropped = self._table.cancel(session)
            if dropped is not None:
                self._counters[METRIC_SESSIONS_CANCELLED] += 1
                self._pending_drops.append(dropped)
        # Free the cache now unless a step is computing (it frees it on return).
        if self._compute_lock.acquire(blocking=False):
            try:
                self._free_pending()
            finally:
                self._compute_lock.release()
        return int(running)

    def release(self, session: SessionKey) -> bool:
        """End the session; with the prefix cache on, its whole prefill blocks stay kept."""
        with self._compute_lock:
            if self._table is None:
                return False
            with self._state_lock:
                dropped, evicted = self._table.release(session, self._clock())
            if dropped is None:
                return False
            self._truncate(dropped, dropped.past_len if dropped.kept else 0)
            for kept in evicted:
                self._truncate(kept, 0)
            with self._state_lock:
                self._counters[METRIC_SESSIONS_RELEASED] += 1
                self._counters[METRIC_PREFIX_KEPT] += int(dropped.kept)
                self._counters[METRIC_PREFIX_EVICTED] += len(evicted)
            return True

    def clear_prefix_cache(self) -> int:
        """Drop every kept prefix now (their slots are emptied); returns how many there were."""
        with self._compute_lock:
            if self._table is None:
                return 0
            with self._state_lock:
                dropped = self._table.drop_kept()
                self._counters[METRIC_PREFIX_EVICTED] += len(dropped)
            for kept in dropped:
                self._truncate(kept, 0)
            return len(dropped)

    def health(self) -> EngineHealth:
        with self._compute_lock:
            if self._table is None:
                return EngineHealth(False, 0, 0, 0, 0, detail="not loaded")
            self._expire()
            sessions = self._table.sessions()
            return EngineHealth(
                loaded=True,
                active_sessions=len(sessions),
                kv_tokens_used=sum(s.past_len for s in sessions),
                kv_tokens_capacity=self._table.capacity * self._max_context,
                resident_bytes=self._resident_bytes(),
            )

    def metrics(self) -> EngineMetrics:
        with self._state_lock:
            counters = dict(self._counters)
            if self._table is not None:
                counters[METRIC_PREFIX_ENTRIES] = len(self._table.kept())
            return EngineMetrics(counters)

    def close(self) -> None:
        with self._compute_lock, self._state_lock:
            if self._caps is None:
                return
            self._close_backend()
            self._caps = None
            self._table = None
            self._pending_drops.clear()

    # --- the step ---

    def _loaded(self) -> tuple[EngineCapabilities, SessionTable]:
        caps, table = self._caps, self._table
        if caps is None or table is None:
            raise EngineError(EngineErrorKind.NOT_LOADED, "no model is loaded")
        return caps, table

    def _step(self, request: StepRequest, *, decode: bool) -> StepResult:
        with self._compute_lock:
            return self._counted_step(request, decode)

    def _counted_step(self, request: StepRequest, decode: bool) -> StepResult:
        """One step with its error accounting (caller holds the compute lock)."""
        try:
            return self._step_locked(request, decode)
        except EngineError as error:
            self._count_refusal(request, error)
            raise
        except Exception:
            self._count(METRIC_ERRORS)
            raise
        finally:
            self._free_pending()

    def _count_refusal(self, request: StepRequest, error: EngineError) -> None:
        self._count(METRIC_ERRORS)
        if error.kind == EngineErrorKind.CACHE_MISS:
            self._count(METRIC_CACHE_MISSES)
        elif error.kind == EngineErrorKind.CANCELLED:
            self._count(METRIC_STEPS_CANCELLED)
            # Asked for (cancel, deadline): not a failure, whatever llama.cpp printed.
            _log.debug("session %s: step aborted as asked (%s)", request.session.session_id, error.detail)

    def _step_locked(self, request: StepRequest, decode: bool) -> StepResult:
        caps, table = self._loaded()
        now = self._clock()
        self._expire(now)
        start_layer, inputs = self._validate(caps, request, decode)
        key = request.session
        if request.cancel_token is not None and request.cancel_token.cancelled:
            raise EngineError(EngineErrorKind.CANCELLED, "step was cancelled before it started")

        prefix: PrefixStart | None = None
        with self._state_lock:
            self._pending_drops += table.admit_epoch(key)
            fresh = not decode and request.first_position == 0
            if fresh:
                session, displaced = table.open(key, start_layer, now)
                self._pending_drops += displaced
                self._count_displaced(displaced, reopened=key)
                self._counters[METRIC_SESSIONS_OPENED] += 1
            elif self._starts_from_prefix(table, request, decode):
                prefix = self._open_from_prefix(table, request, start_layer, now)
                session = prefix.session
            else:
                session = self._continuing_session(table, request, decode, start_layer)
            self._running.add(key)
        if fresh or prefix is not None:
            self._free_pending()  # a reused slot must be empty before the step writes to it
        if prefix is not None:
            self._place_prefix(prefix, request.first_position)

        want_logits = caps.is_tail and (request.sampling is not None or request.want_logits)
        forward = self._forward_verify if request.draft_tokens else self._forward
        started = time.perf_counter_ns()
        try:
            output = forward(session, request.first_position, inputs, want_logits, self._abort_check(request))
        except EngineError as error:
            self._after_failed_forward(session, error)
            raise
        except BaseException:
            self._forget(session)
            raise
        finally:
            self._finish_running((key,))
        elapsed = time.perf_counter_ns() - started
        return self._commit(request, session, output, fresh, elapsed, decode)

    @staticmethod
    def _starts_from_prefix(table: SessionTable, request: StepRequest, decode: bool) -> bool:
        """A session's first step naming a kept prefix to start from (a step of a session already
        held, or of one cancelled, is judged as it always is)."""
        return (
            not decode
            and bool(request.prefix_digest)
            and not request.draft_tokens
            and table.lookup(request.session) is None
            and not table.is_cancelled(request.session)
        )

    def _open_from_prefix(
        self, table: SessionTable, request: StepRequest, start_layer: int, now: float
    ) -> PrefixStart:
        """(Caller holds the state lock.) The session opened from the kept prefix the step names,
        or the CACHE_MISS at length 0 that sends the head back to a full prefill."""
        length = request.first_position
        prefix = table.open_from_prefix(request.session, start_layer, length, request.prefix_digest, now)
        if prefix is None:
            self._counters[METRIC_PREFIX_MISSES] += 1
            raise EngineError(
                EngineErrorKind.CACHE_MISS,
                f"session {request.session.session_id!r}@{request.session.epoch}: no kept prefix of "
                f"{length} positions with this digest; prefill from position 0",
                actual_past_len=0,
            )
        self._pending_drops += prefix.evicted
        self._counters[METRIC_PREFIX_EVICTED] += len(prefix.evicted)
        self._counters[METRIC_PREFIX_HITS] += 1
        self._counters[METRIC_PREFIX_TOKENS_REUSED] += length
        self._counters[METRIC_SESSIONS_OPENED] += 1
        return prefix

    def _place_prefix(self, prefix: PrefixStart, length: int) -> None:
        """Make the new session's slot hold the prefix: a copy of the kept one, or the adopted slot
        cut to ``length``. A failure leaves no session behind (the step then fails as a miss would)."""
        try:
            if prefix.copied:
                self._copy_prefix(prefix.source, prefix.session, length)
            else:
                self._truncate(prefix.session, length)
        except BaseException:
            self._finish_running((prefix.session.key,))
            self._forget(prefix.session)
            self._free_pending()
            raise

    def _count_displaced(self, displaced: Sequence[Session], reopened: SessionKey | None = None) -> None:
        """(Caller holds the state lock.) Live sessions and kept prefixes pushed out (a session
        ``reopened`` by a fresh prefill is not counted as evicted)."""
        self._counters[METRIC_SESSIONS_EVICTED] += sum(
            1 for s in displaced if not s.kept and s.key != reopened
        )
        self._counters[METRIC_PREFIX_EVICTED] += sum(1 for s in displaced if s.kept)

    def _forward_verify(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        """A verify step's positions one at a time, each a one-token ``_forward`` as its decode
        would be, so the result is bit for bit what plain decoding computes: the hidden rows
        (non-tail) or every position's logits (tail), stacked. A failure or cancel between
        positions leaves the session back at ``first_position``."""
        hidden: list[np.ndarray] = []
        logits: list[np.ndarray] = []
        try:
            for offset in range(int(inputs.shape[0])):
                if offset and should_abort():
                    raise EngineError(EngineErrorKind.CANCELLED, "step cancelled while running")
                row = self._forward(
                    session, first_position + offset, inputs[offset : offset + 1], want_logits, should_abort
                )
                if row.hidden is not None:
                    hidden.append(row.hidden)
                if row.logits is not None:
                    # A backend's logits may be a view of a buffer the next forward overwrites.
                    logits.append(np.array(row.logits, dtype=np.float32, copy=True))
        except BaseException:
            self._truncate(session, first_position)
            raise
        return ForwardOutput(
            hidden=np.concatenate(hidden) if hidden else None,
            logits=np.stack(logits) if logits else None,
        )

    def _abort_check(self, request: StepRequest) -> Callable[[], bool]:
        key, token = request.session, request.cancel_token
        if token is not None:
            return lambda: key in self._cancelled_running or token.cancelled
        return lambda: key in self._cancelled_running

    def _after_failed_forward(self, session: Session, error: EngineError) -> None:
        if error.kind not in (EngineErrorKind.CANCELLED, EngineErrorKind.RESOURCE_EXHAUSTED):
            self._forget(session)  # state after an internal failure cannot be trusted

    def _finish_running(self, keys: Sequence[SessionKey]) -> None:
        """Mark the keys' steps done; returns nothing, a cancel that landed meanwhile has
        already dropped its session from the table (``_commit`` sees it there)."""
        with self._state_lock:
            for key in keys:
                self._running.discard(key)
                self._cancelled_running.discard(key)

    def _commit(
        self,
        request: StepRequest,
        session: Session,
        output: ForwardOutput,
        fresh: bool,
        elapsed: int,
        decode: bool,
    ) -> StepResult:
        table = self._table
        with self._state_lock:
            if table is None or table.lookup(request.session) is not session:
                # Cancelled while computing: cancel() already dropped the session, and its
                # storage is freed with the pending drops; what the step computed is discarded.
                raise EngineError(EngineErrorKind.CANCELLED, "session was cancelled during the step")
            session.past_len = request.first_position + request.n_tokens
            session.committed_len = session.past_len - request.draft_tokens
            if not decode and not request.draft_tokens:
                session.record_block(request.first_position, session.past_len, request.block_digest)
            table.touch(session, self._clock())
        # A verify step (speculative decoding) runs the prefill path but is decoding work.
        self._count(METRIC_DECODE_STEPS if decode or request.draft_tokens else METRIC_PREFILL_STEPS)
        self._count(METRIC_TOKENS_PROCESSED, request.n_tokens)
        return self._result(request, session, output, fresh, elapsed)

    # --- batches ---

    def step_batch(self, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        """Each step's outcome as if it ran alone: the decodes are admitted in order and
        computed together per start layer, then the prefill chunks run one by one."""
        outcomes: list[StepOutcome | None] = [None] * len(steps)
        with self._compute_lock:
            admitted: list[_AdmittedDecode] = []
            try:
                self._admit_decodes(steps, outcomes, admitted)
                groups: dict[int, list[_AdmittedDecode]] = {}
                for decode in admitted:
                    groups.setdefault(decode.entry.session.start_layer, []).append(decode)
                for group in groups.values():
                    self._run_decode_group(group, outcomes)
            finally:
                # Also the groups a failed group kept from running: a key left marked running
                # would turn a later cancel of it into an abort of its next, unrelated step.
                self._finish_running([decode.request.session for decode in admitted])
                self._free_pending()
            for index, step in enumerate(steps):
                if outcomes[index] is None:
                    try:
                        outcomes[index] = self._counted_step(step.request, decode=False)
                    except EngineError as error:
                        outcomes[index] = error
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(outcomes)
        return done

    def _admit_decodes(
        self,
        steps: Sequence[BatchStep],
        outcomes: list[StepOutcome | None],
        admitted: list[_AdmittedDecode],
    ) -> None:
        """Check every step's session and cache as its step would alone; record refusals in
        ``outcomes`` and append the decodes to compute to ``admitted`` (as each is marked
        running, so the caller can unmark them whatever happens). Prefills are left for later."""
        seen: set[SessionKey] = set()
        now = self._clock()
        self._expire(now)
        for index, step in enumerate(steps):
            request = step.request
            if request.session in seen:
                outcomes[index] = self._refuse(
                    request,
                    EngineError(
                        EngineErrorKind.INVALID_REQUEST, "a batch carries at most one step per session"
                    ),
                )
                continue
            seen.add(request.session)
            if not step.decode:
                continue
            try:
                admitted.append(_AdmittedDecode(index, request, self._admit_decode(request)))
            except EngineError as error:
                outcomes[index] = self._refuse(request, error)

    def _admit_decode(self, request: StepRequest) -> BatchEntry:
        caps, table = self._loaded()
        start_layer, inputs = self._validate(caps, request, True)
        if request.cancel_token is not None and request.cancel_token.cancelled:
            raise EngineError(EngineErrorKind.CANCELLED, "step was cancelled before it started")
        with self._state_lock:
            self._pending_drops += table.admit_epoch(request.session)
            session = self._continuing_session(table, request, True, start_layer)
            self._running.add(request.session)
        want_logits = caps.is_tail and (request.sampling is not None or request.want_logits)
        return BatchEntry(session, request.first_position, inputs, want_logits, self._abort_check(request))

    def _refuse(self, request: StepRequest, error: EngineError) -> EngineError:
        self._count_refusal(request, error)
        return error

    def _run_decode_group(self, group: list[_AdmittedDecode], outcomes: list[StepOutcome | None]) -> None:
        keys = [decode.request.session for decode in group]
        started = time.perf_counter_ns()
        try:
            outputs = self._forward_batch([decode.entry for decode in group])
            # Nothing polls a shared pass, so a cancel (of the step's token or of its session)
            # that landed while it computed is honoured here: that step alone is CANCELLED and
            # what it computed is rolled back, as a solo step aborted in time would leave it.
            aborted = [decode.entry.should_abort() for decode in group]
        except BaseException:
            # What the batch left in any of its sessions cannot be trusted.
            for decode in group:
                self._forget(decode.entry.session)
            self._count(METRIC_ERRORS)
            raise
        finally:
            self._finish_running(keys)
        # Every step of a batch reports the batch's time: that is what it waited for.
        elapsed = time.perf_counter_ns() - started
        for decode, output, abort in zip(group, outputs, aborted, strict=True):
            request, session = decode.request, decode.entry.session
            if abort and not isinstance(output, EngineError):
                self._truncate(session, request.first_position)
                output = EngineError(EngineErrorKind.CANCELLED, "step was cancelled during the batch")
            try:
                if isinstance(output, EngineError):
                    self._after_failed_forward(session, output)
                    raise output
                outcomes[decode.index] = self._commit(request, session, output, False, elapsed, True)
            except EngineError as error:
                outcomes[decode.index] = self._refuse(request, error)

    def _continuing_session(
        self, table: SessionTable, request: StepRequest, decode: bool, start_layer: int
    ) -> Session:
        key = request.session
        if table.is_cancelled(key):
            raise EngineError(
                EngineErrorKind.CANCELLED, "session was cancelled; a fresh prefill at position 0 reopens it"
            )
        expected = request.first_position
        session = table.lookup(key)
        actual = session.past_len if session is not None else 0
        if session is not None and request.rollback and actual != expected:
            refusal = rollback_refusal(actual, session.committed_len, expected)
            if refusal is not None:
                raise EngineError(
                    EngineErrorKind.CACHE_MISS,
                    f"session {key.session_id!r}@{key.epoch}: {refusal}",
                    actual_past_len=actual,
                )
        elif session is None or actual != expected:
            raise EngineError(
                EngineErrorKind.CACHE_MISS,
                f"session {key.session_id!r}@{key.epoch} holds {actual} tokens, the step expects {expected}",
                actual_past_len=actual,
            )
        if session.start_layer != start_layer:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"session started at layer {session.start_layer}; it cannot continue from layer {start_layer}",
            )
        if actual != expected:
            # The rejected drafts go before the step runs (the caller holds the compute lock), so
            # the step computes over exactly the accepted tokens, and a failure of it leaves the
            # session at ``expected`` as every failed step must.
            self._truncate(session, expected)
            session.past_len = session.committed_len = expected
            session.cut_blocks(expected)
        return session

    def _validate(
        self, caps: EngineCapabilities, request: StepRequest, decode: bool
    ) -> tuple[int, np.ndarray]:
        start = caps.layer_start if request.effective_start_layer is None else request.effective_start_layer
        if not caps.layer_start <= start < caps.layer_end:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"effective start layer {start} is outside the loaded range [{caps.layer_start}, {caps.layer_end})",
            )
        if decode:
            if request.n_tokens != 1:
                raise EngineError(EngineErrorKind.INVALID_REQUEST, "a decode step carries exactly one token")
            if request.expected_past_len is not None and request.expected_past_len != request.first_position:
                raise EngineError(
                    EngineErrorKind.INVALID_REQUEST,
                    f"decode at position {request.first_position} cannot expect {request.expected_past_len} "
                    "cached tokens",
                )
        if request.first_position + request.n_tokens > self._max_context:
            raise EngineError(
                EngineErrorKind.RESOURCE_EXHAUSTED,
                f"positions up to {request.first_position + request.n_tokens} exceed the per-session "
                f"context of {self._max_context}",
            )
        if not caps.is_tail and (request.sampling is not None or request.want_logits):
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST, "only the tail shard samples or returns logits"
            )
        if request.sampling is not None:
            validate_sampling(request.sampling)
        if request.sample_index < 0:
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "sample_index is negative")
        sampling = request.sampling
        if (
            request.draft_tokens
            and caps.is_tail
            and sampling is not None
            and not supports_speculation(sampling)
        ):
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                "drafts are verified for greedy or seeded sampling only (no penalty or grammar)",
            )
        return start, self._validated_inputs(caps, request, start)

    @staticmethod
    def _validated_inputs(caps: EngineCapabilities, request: StepRequest, start: int) -> np.ndarray:
        if start == 0:
            if request.token_ids is None:
                raise EngineError(
                    EngineErrorKind.INVALID_REQUEST, "a step starting at layer 0 takes token ids"
                )
            tokens = np.fromiter(request.token_ids, dtype=np.int64, count=len(request.token_ids))
            # A decode's one token is compared as a scalar: numpy's min and max reductions cost
            # several microseconds each, every token.
            lowest, highest = (tokens[0], tokens[0]) if tokens.shape[0] == 1 else (tokens.min(), tokens.max())
            if lowest < 0 or highest >= caps.vocab_size:
                raise EngineError(
                    EngineErrorKind.INVALID_REQUEST, f"token id outside the vocabulary [0, {caps.vocab_size})"
                )
            return tokens.astype(np.int32)
        hidden = request.hidden
        if hidden is None:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST, f"a step starting at layer {start} takes a hidden state"
            )
        if hidden.dtype != np.float32 or hidden.ndim != 2 or hidden.shape[1] != caps.hidden_size:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"hidden state must be float32 [n, {caps.hidden_size}], got {hidden.dtype} {list(hidden.shape)}",
            )
        if not np.isfinite(hidden).all():
            raise EngineError(EngineErrorKind.INVALID_REQUEST, "hidden state contains NaN or infinity")
        return np.ascontiguousarray(hidden)

    def grammar_vocabulary(self) -> object | None:
        """The vocabulary a grammar constrains this tail's sampling over (a llama_vocab pointer);
        None: this engine cannot apply one, and a step asking for a grammar is refused."""
        return None

    def grammar_state(self, grammar: str) -> GrammarState | None:
        """GBNF ``grammar`` at its start over :meth:`grammar_vocabulary`, for the sampler of a
        session that asks for one (llama.cpp's grammar sampler); None: this engine has no
        vocabulary to apply it over."""
        vocabulary = self.grammar_vocabulary()
        if vocabulary is None:
            return None
        from engines.grammar import GrammarConstraint  # llama.cpp, only when a grammar is used

        # grammar_vocabulary() is a llama_vocab pointer where it is not None (an engine on llama.cpp).
        return GrammarConstraint(cast("llama_cpp.llama_vocab_p", vocabulary), grammar)

    def _result(
        self, request: StepRequest, session: Session, output: ForwardOutput, fresh: bool, elapsed: int
    ) -> StepResult:
        token_id = None
        token_ids = None
        logits = None
        if output.logits is not None:
            rows = output.logits
            if request.draft_tokens and rows.ndim == 2:
                if request.sampling is not None:
                    # The position after row i is first_position + i + 1: the index a decode there
                    # samples with, so a seeded draw is the one plain decoding makes.
                    first = request.first_position
                    token_ids = tuple(
                        sample_token(row, request.sampling, first + i + 1, self.grammar_state)
                        for i, row in enumerate(rows)
                    )
                    token_id = token_ids[-1]
                last = rows[-1]
            else:
                last = rows
                if request.sampling is not None:
                    token_id = sample_token(last, request.sampling, request.sample_index, self.grammar_state)
            if request.want_logits:
                logits = np.array(last, dtype=np.float32, copy=True)
        return StepResult(
            past_len=session.past_len,
            cache_hit=not fresh,
            hidden=output.hidden,
            token_id=token_id,
            token_ids=token_ids,
            logits=logits,
            execution_nanos=elapsed,
        )

    # --- state housekeeping ---

    def _count(self, name: str, amount: int = 1) -> None:
        with self._state_lock:
            self._counters[name] += amount

    def _forget(self, session: Session) -> None:
        with self._state_lock:
            table = self._table
            if table is not None and table.lookup(session.key) is session:
                table.remove(session.key)
                self._pending_drops.append(session)

    def _expire(self, now: float | None = None) -> None:
        with self._state_lock:
            if self._table is None:
                return
            expired = self._table.expire(self._clock() if now is None else now)
            self._counters[METRIC_SESSIONS_EXPIRED] += sum(1 for s in expired if not s.kept)
            self._counters[METRIC_PREFIX_EVICTED] += sum(1 for s in expired if s.kept)
            self._pending_drops += expired
        self._free_pending()

    def _discard_sessions_starting_at(self, start_layer: int) -> None:
        """For backends that unload the storage of one start layer (e.g. an evicted slice)."""
        with self._state_lock:
            if self._table is None:
                return
            doomed = self._table.remove_where_start(start_layer)
            self._count_displaced(doomed)
            self._pending_drops += doomed
        self._free_pending()

    def _free_pending(self) -> None:
        """Clear the backend storage of dropped sessions (caller holds the compute lock)."""
        with self._state_lock:
            pending, self._pending_drops = self._pending_drops, []
        for session in pending:
            self._truncate(session, 0)
