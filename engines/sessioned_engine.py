"""The ShardEngine contract implemented once, over a backend that only runs layers.

``SessionedEngine`` owns everything the fake and the llama.cpp engine must do alike:
input validation, epochs, cache expectations (``CACHE_MISS`` with the actual length),
cancellation (per step and per session), TTL and LRU eviction, metrics, and tail-side
sampling. A backend implements four hooks: load, forward, truncate and close.

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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engines.interface import (
    METRIC_CACHE_MISSES,
    METRIC_DECODE_STEPS,
    METRIC_ERRORS,
    METRIC_PREFILL_STEPS,
    METRIC_SESSIONS_CANCELLED,
    METRIC_SESSIONS_EVICTED,
    METRIC_SESSIONS_EXPIRED,
    METRIC_SESSIONS_OPENED,
    METRIC_SESSIONS_RELEASED,
    METRIC_STEPS_CANCELLED,
    METRIC_TOKENS_PROCESSED,
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineHealth,
    EngineMetrics,
    LoadRequest,
    SessionKey,
    ShardEngine,
    StepRequest,
    StepResult,
)
from engines.sampling import sample_token, validate_sampling
from engines.session_table import Session, SessionTable

_log = logging.getLogger("engines.sessioned_engine")


@dataclass(frozen=True)
class ForwardOutput:
    # Non-tail: float32 [n_tokens, hidden_size].
    hidden: np.ndarray | None = None
    # Tail, when logits were asked for: the last position's logits (may be a view).
    logits: np.ndarray | None = None


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
        self._running: SessionKey | None = None
        self._running_cancelled = False
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

    @abstractmethod
    def _truncate(self, session: Session, length: int) -> None:
        """Drop the session's cached positions >= ``length`` (0: all of them)."""

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
                self._table = SessionTable(request.n_seq_max, request.session_ttl_s)
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
            running = self._running == session
            if running:
                self._running_cancelled = True
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
        with self._compute_lock:
            if self._table is None:
                return False
            with self._state_lock:
                dropped = self._table.remove(session)
            if dropped is None:
                return False
            self._truncate(dropped, 0)
            self._count(METRIC_SESSIONS_RELEASED)
            return True

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
            return EngineMetrics(dict(self._counters))

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
            try:
                return self._step_locked(request, decode)
            except EngineError as error:
                self._count(METRIC_ERRORS)
                if error.kind == EngineErrorKind.CACHE_MISS:
                    self._count(METRIC_CACHE_MISSES)
                elif error.kind == EngineErrorKind.CANCELLED:
                    self._count(METRIC_STEPS_CANCELLED)
                    # Asked for (cancel, deadline): not a failure, whatever llama.cpp printed.
                    _log.debug(
                        "session %s: step aborted as asked (%s)", request.session.session_id, error.detail
                    )
                raise
            except Exception:
                self._count(METRIC_ERRORS)
                raise
            finally:
                self._free_pending()

    def _step_locked(self, request: StepRequest, decode: bool) -> StepResult:
        caps, table = self._loaded()
        now = self._clock()
        self._expire(now)
        start_layer, inputs = self._validate(caps, request, decode)
        key = request.session
        if request.cancel_token is not None and request.cancel_token.cancelled:
            raise EngineError(EngineErrorKind.CANCELLED, "step was cancelled before it started")

        with self._state_lock:
            self._pending_drops += table.admit_epoch(key)
            fresh = not decode and request.first_position == 0
            if fresh:
                session, displaced = table.open(key, start_layer, now)
                self._pending_drops += displaced
                self._counters[METRIC_SESSIONS_EVICTED] += sum(1 for s in displaced if s.key != key)
                self._counters[METRIC_SESSIONS_OPENED] += 1
            else:
                session = self._continuing_session(table, request, decode, start_layer)
            self._running, self._running_cancelled = key, False
        if fresh:
            self._free_pending()  # a reused slot must be empty before the step writes to it

        token = request.cancel_token
        should_abort = (
            (lambda: self._running_cancelled or token.cancelled)
            if token
            else (lambda: self._running_cancelled)
        )
        want_logits = caps.is_tail and (request.sampling is not None or request.want_logits)
        started = time.perf_counter_ns()
        try:
            output = self._forward(session, request.first_position, inputs, want_logits, should_abort)
        except EngineError as error:
            if error.kind not in (EngineErrorKind.CANCELLED, EngineErrorKind.RESOURCE_EXHAUSTED):
                self._forget(session)  # state after an internal failure cannot be trusted
            raise
        except BaseException:
            self._forget(session)
            raise
        finally:
            with self._state_lock:
                self._running = None
        elapsed = time.perf_counter_ns() - started

        with self._state_lock:
            if self._running_cancelled or table.lookup(key) is not session:
                # Cancelled while finishing: cancel() already dropped the session.
                raise EngineError(EngineErrorKind.CANCELLED, "session was cancelled during the step")
            session.past_len = request.first_position + request.n_tokens
            table.touch(session, self._clock())
        self._count(METRIC_DECODE_STEPS if decode else METRIC_PREFILL_STEPS)
        self._count(METRIC_TOKENS_PROCESSED, request.n_tokens)
        return self._result(request, session, output, fresh, elapsed)

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
        if session is None or actual != expected:
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
        return start, self._validated_inputs(caps, request, start)

    @staticmethod
    def _validated_inputs(caps: EngineCapabilities, request: StepRequest, start: int) -> np.ndarray:
        if start == 0:
            if request.token_ids is None:
                raise EngineError(
                    EngineErrorKind.INVALID_REQUEST, "a step starting at layer 0 takes token ids"
                )
            tokens = np.fromiter(request.token_ids, dtype=np.int64, count=len(request.token_ids))
            if tokens.min() < 0 or tokens.max() >= caps.vocab_size:
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

    def _result(
        self, request: StepRequest, session: Session, output: ForwardOutput, fresh: bool, elapsed: int
    ) -> StepResult:
        token_id = None
        logits = None
        if output.logits is not None:
            if request.sampling is not None:
                token_id = sample_token(output.logits, request.sampling, request.sample_index)
            if request.want_logits:
                logits = np.array(output.logits, dtype=np.float32, copy=True)
        return StepResult(
            past_len=session.past_len,
            cache_hit=not fresh,
            hidden=output.hidden,
            token_id=token_id,
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
            self._counters[METRIC_SESSIONS_EXPIRED] += len(expired)
            self._pending_drops += expired
        self._free_pending()

    def _discard_sessions_starting_at(self, start_layer: int) -> None:
        """For backends that unload the storage of one start layer (e.g. an evicted slice)."""
        with self._state_lock:
            if self._table is None:
                return
            doomed = self._table.remove_where_start(start_layer)
            self._counters[METRIC_SESSIONS_EVICTED] += len(doomed)
            self._pending_drops += doomed
        self._free_pending()

    def _free_pending(self) -> None:
        """Clear the backend storage of dropped sessions (caller holds the compute lock)."""
        with self._state_lock:
            pending, self._pending_drops = self._pending_drops, []
        for session in pending:
            self._truncate(session, 0)
