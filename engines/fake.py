"""A deterministic fake shard engine with real cache semantics and injectable faults.

The "model" is small float32 math, seeded: token embedding, then per layer
``y = x + 0.5 * tanh(A x + B mean(x_0..x_p))`` where the running mean is over the layer's
inputs at every cached position of the session, then ``logits = U y``. A token's output
therefore depends on the session's cached past, so a lost or misaligned cache changes the
answer, and chaining shards split anywhere gives bit-identical results to the whole model
(every position is computed by the same per-token operations in the same order).

Faults (``FaultRule``) are injected inside the step, where a real engine computes: a delay
that honours cancellation, memory pressure (``RESOURCE_EXHAUSTED``), malformed output (a
wrong shape or NaNs, for the data plane's validation), and crashes (an unexpected
exception, or a hard process exit for multi-process tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np

from engines.interface import (
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineFingerprint,
    LoadRequest,
)
from engines.session_table import Session
from engines.sessioned_engine import ForwardOutput, SessionedEngine

FAKE_RECIPE_ID = "meshnode-fake"
FAKE_RECIPE_VERSION = "1"
# What the fake engine reports as its numerics unless told otherwise; protocol tests pass
# another value to play hops that compute differently within one contract.
FAKE_NUMERICS = "numpy float32; cpu"


@dataclass(frozen=True)
class FakeModelSpec:
    total_layers: int = 8
    hidden_size: int = 16
    vocab_size: int = 64
    seed: int = 0
    name: str = "fake-model"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


class FaultKind(Enum):
    # Raise RESOURCE_EXHAUSTED before touching the session.
    MEMORY_PRESSURE = "memory_pressure"
    # Non-tail: hidden with one extra column; tail: logits one longer, sampling token vocab_size.
    MALFORMED_SHAPE = "malformed_shape"
    # Non-tail: hidden full of NaN; tail: NaN logits.
    MALFORMED_NAN = "malformed_nan"
    # Raise ``InjectedCrash`` (an unexpected exception, not an EngineError).
    CRASH = "crash"
    # ``os._exit(exit_code)``: the process dies mid-step.
    EXIT = "exit"


@dataclass(frozen=True)
class FaultRule:
    kind: FaultKind
    # Matching steps that run cleanly before the fault first fires.
    after_steps: int = 0
    # How many matching steps it fires on; ``None``: every one from then on.
    times: int | None = None
    # Only steps of this session id (any epoch); ``None``: every session.
    session_id: str | None = None
    exit_code: int = 70


class InjectedCrash(RuntimeError):
    """The fake engine's simulated internal failure."""


@dataclass
class _RuleState:
    rule: FaultRule
    seen: int = 0
    fired: int = 0

    def fires(self, session_id: str) -> bool:
        if self.rule.session_id is not None and self.rule.session_id != session_id:
            return False
        self.seen += 1
        if self.seen <= self.rule.after_steps:
            return False
        if self.rule.times is not None and self.fired >= self.rule.times:
            return False
        self.fired += 1
        return True


class _FakeWeights:
    def __init__(self, spec: FakeModelSpec) -> None:
        rng = np.random.default_rng(spec.seed)
        h = spec.hidden_size
        scale = np.float32(1.0 / np.sqrt(h))
        self.embedding = rng.standard_normal((spec.vocab_size, h), dtype=np.float32)
        self.a = [rng.standard_normal((h, h), dtype=np.float32) * scale for _ in range(spec.total_layers)]
        self.b = [rng.standard_normal((h, h), dtype=np.float32) * scale for _ in range(spec.total_layers)]
        self.unembedding = rng.standard_normal((spec.vocab_size, h), dtype=np.float32) * scale


@dataclass
class _FakeCache:
    # Per layer run by the session: the running sum of that layer's inputs after each position.
    prefix_sums: list[list[np.ndarray]] = field(default_factory=list)


class FakeEngine(SessionedEngine):
    """``load`` ignores ``model_path``: the model is ``spec``."""

    def __init__(
        self,
        spec: FakeModelSpec | None = None,
        *,
        faults: Sequence[FaultRule] = (),
        step_delay_s: float = 0.0,
        fingerprint: EngineFingerprint | None = None,
        numerics: str = FAKE_NUMERICS,
        exact_numerics: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(clock=clock)
        self.spec = spec or FakeModelSpec()
        self.step_delay_s = step_delay_s
        self.numerics = numerics
        # The fake's math is per token in a fixed order: bit-exact across splits and batches.
        self.exact_numerics = exact_numerics
        self._fingerprint = fingerprint or EngineFingerprint(
            model_artifact_digest=self.spec.digest(),
            runtime_recipe_digest=hashlib.sha256(
                f"{FAKE_RECIPE_ID}/{FAKE_RECIPE_VERSION}".encode()
            ).hexdigest(),
            recipe_id=FAKE_RECIPE_ID,
            recipe_version=FAKE_RECIPE_VERSION,
        )
        self._sleep = sleep
        self._faults_lock = threading.Lock()
        self._rules = [_RuleState(rule) for rule in faults]
        self._weights = _FakeWeights(self.spec)
        self._caches: dict[int, _FakeCache] = {}
        self._layer_end = 0
        self._is_tail = False

    # --- fault control (any thread) ---

    def inject(self, rule: FaultRule) -> None:
        with self._faults_lock:
            self._rules.append(_RuleState(rule))

    def _firing(self, session_id: str) -> dict[FaultKind, FaultRule]:
        with self._faults_lock:
            return {state.rule.kind: state.rule for state in self._rules if state.fires(session_id)}

    # --- backend hooks ---

    def _load_backend(self, request: LoadRequest) -> tuple[EngineCapabilities, int]:
        total = self.spec.total_layers
        end = total if request.layer_end is None else request.layer_end
        if not 0 <= request.layer_start < end <= total:
            raise EngineError(
                EngineErrorKind.INVALID_REQUEST,
                f"layer range [{request.layer_start}, {end}) is not inside a {total}-layer model",
            )
        self._layer_end, self._is_tail = end, end == total
        caps = EngineCapabilities(
            fingerprint=self._fingerprint,
            model_name=self.spec.name,
            architecture="fake",
            total_layers=total,
            layer_start=request.layer_start,
            layer_end=end,
            hidden_size=self.spec.hidden_size,
            vocab_size=self.spec.vocab_size,
            max_sessions=request.n_seq_max,
            max_context_tokens=request.n_ctx,
            backend="numpy",
            device="cpu",
            numerics=self.numerics,
            exact_numerics=self.exact_numerics,
            # Its rows are each computed alone, whatever the pass.
            size_free_prefill=self.exact_numerics,
        )
        return caps, request.n_ctx

    def _close_backend(self) -> None:
        self._caches.clear()

    def _truncate(self, session: Session, length: int) -> None:
        cache = self._caches.get(session.slot)
        if cache is None:
            return
        if length == 0:
            del self._caches[session.slot]
            return
        for sums in cache.prefix_sums:
            del sums[length:]

    def _copy_prefix(self, source: Session, target: Session, length: int) -> None:
        cache = self._caches.get(source.slot)
        if cache is None or not cache.prefix_sums or len(cache.prefix_sums[0]) < length:
            raise EngineError(
                EngineErrorKind.INTERNAL, f"slot {source.slot} does not hold {length} positions"
            )
        if target.slot in self._caches:
            raise EngineError(EngineErrorKind.INTERNAL, f"slot {target.slot} is not empty")
        self._caches[target.slot] = _FakeCache(
            [[s.copy() for s in sums[:length]] for sums in cache.prefix_sums]
        )

    def _resident_bytes(self) -> int:
        weights = self._weights
        total = weights.embedding.nbytes + weights.unembedding.nbytes
        total += sum(a.nbytes + b.nbytes for a, b in zip(weights.a, weights.b, strict=True))
        return total + sum(s.nbytes for c in self._caches.values() for sums in c.prefix_sums for s in sums)

    def _forward(
        self,
        session: Session,
        first_position: int,
        inputs: np.ndarray,
        want_logits: bool,
        should_abort: Callable[[], bool],
    ) -> ForwardOutput:
        firing = self._firing(session.key.session_id)
        self._delay(should_abort)
        if FaultKind.EXIT in firing:
            os._exit(firing[FaultKind.EXIT].exit_code)
        if FaultKind.CRASH in firing:
            raise InjectedCrash(f"injected crash in session {session.key.session_id!r}")
        if FaultKind.MEMORY_PRESSURE in firing:
            raise EngineError(EngineErrorKind.RESOURCE_EXHAUSTED, "injected memory pressure")

        cache = self._caches.setdefault(session.slot, _FakeCache())
        layers = range(session.start_layer, self._layer_end)
        if not cache.prefix_sums:
            cache.prefix_sums = [[] for _ in layers]
        hidden = self._embed(inputs) if session.start_layer == 0 else inputs.copy()
        for offset, layer in enumerate(layers):
            hidden = self._layer(layer, hidden, cache.prefix_sums[offset], first_position)
        if not self._is_tail:
            return ForwardOutput(hidden=self._malformed_hidden(hidden, firing))
        logits = None
        if want_logits:
            logits = self._malformed_logits(self.unembed(hidden[-1]), firing)
        return ForwardOutput(logits=logits)

    # --- the model ---

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self._weights.embedding[token_ids].copy()

    def _layer(
        self, layer: int, hidden: np.ndarray, prefix_sums: list[np.ndarray], first_position: int
    ) -> np.ndarray:
        a, b = self._weights.a[layer], self._weights.b[layer]
        out = np.empty_like(hidden)
        running = prefix_sums[-1] if prefix_sums else np.zeros(hidden.shape[1], dtype=np.float32)
        for row in range(hidden.shape[0]):
            x = hidden[row]
            running = running + x
            prefix_sums.append(running)
            mean = running / np.float32(first_position + row + 1)
            out[row] = x + np.float32(0.5) * np.tanh(a @ x + b @ mean)
        return out

    def unembed(self, last_hidden: np.ndarray) -> np.ndarray:
        return self._weights.unembedding @ last_hidden

    def _delay(self, should_abort: Callable[[], bool]) -> None:
        deadline = self._clock() + self.step_delay_s
        while self.step_delay_s > 0 and self._clock() < deadline:
            if should_abort():
                raise EngineError(EngineErrorKind.CANCELLED, "step cancelled during the injected delay")
            self._sleep(min(0.005, max(0.0, deadline - self._clock())))
        if should_abort():
            raise EngineError(EngineErrorKind.CANCELLED, "step cancelled")

    @staticmethod
    def _malformed_hidden(hidden: np.ndarray, firing: dict[FaultKind, FaultRule]) -> np.ndarray:
        if FaultKind.MALFORMED_SHAPE in firing:
            return np.concatenate([hidden, np.zeros((hidden.shape[0], 1), dtype=np.float32)], axis=1)
        if FaultKind.MALFORMED_NAN in firing:
            return np.full_like(hidden, np.nan)
        return hidden

    @staticmethod
    def _malformed_logits(logits: np.ndarray, firing: dict[FaultKind, FaultRule]) -> np.ndarray:
        if FaultKind.MALFORMED_SHAPE in firing:
            return np.append(logits, np.float32(np.abs(logits).max() + 1.0))
        if FaultKind.MALFORMED_NAN in firing:
            return np.full_like(logits, np.nan)
        return logits
