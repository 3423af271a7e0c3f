"""A tiny deterministic ShardEngine for protocol tests, until ``engines.fake`` lands.

It computes something model-shaped so that protocol mistakes show up in the
numbers: each layer mixes the incoming hidden state with a per-session running
state, so a skipped, repeated or re-ordered step changes every later output, and
a split range gives bit-identical results to the whole range (float32 end to end).
Faults are injected with ``fail_next`` / ``result_next``; every call is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engines.interface import (
    EngineCapabilities,
    EngineError,
    EngineErrorKind,
    EngineFingerprint,
    EngineHealth,
    EngineMetrics,
    LoadRequest,
    SessionKey,
    ShardEngine,
    StepRequest,
    StepResult,
)

HIDDEN = 8
VOCAB = 32
LAYERS = 4
FINGERPRINT = EngineFingerprint(
    model_artifact_digest="sha256:tiny-model", runtime_recipe_digest="sha256:tiny-recipe", recipe_id="tiny"
)


def _embed(token: int, position: int) -> np.ndarray:
    lanes = np.arange(HIDDEN, dtype=np.float32)
    return (
        np.sin(np.float32(token) * np.float32(0.7) + lanes * np.float32(0.3)) + np.float32(0.01) * position
    ).astype(np.float32)


_OUT = np.cos(
    np.arange(VOCAB, dtype=np.float32)[:, None] * np.float32(0.37)
    + np.arange(HIDDEN, dtype=np.float32)[None, :] * np.float32(1.1)
).astype(np.float32)


@dataclass
class _State:
    past_len: int = 0
    memory: dict[int, np.ndarray] = field(default_factory=dict)


class TinyEngine(ShardEngine):
    def __init__(
        self, layer_start: int = 0, layer_end: int = LAYERS, *, max_sessions: int = 4, max_context: int = 64
    ) -> None:
        self.caps = EngineCapabilities(
            fingerprint=FINGERPRINT,
            model_name="tiny",
            architecture="tiny",
            total_layers=LAYERS,
            layer_start=layer_start,
            layer_end=layer_end,
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            max_sessions=max_sessions,
            max_context_tokens=max_context,
            backend="cpu",
            device="cpu:test",
        )
        self.sessions: dict[SessionKey, _State] = {}
        self.calls: list[StepRequest] = []
        self.released: list[SessionKey] = []
        self.fail_next: BaseException | None = None
        self.result_next: object = None

    def load(self, request: LoadRequest) -> EngineCapabilities:
        return self.caps

    def capabilities(self) -> EngineCapabilities:
        return self.caps

    def prefill(self, request: StepRequest) -> StepResult:
        return self._step(request, decode=False)

    def decode(self, request: StepRequest) -> StepResult:
        return self._step(request, decode=True)

    def _step(self, request: StepRequest, *, decode: bool) -> StepResult:
        self.calls.append(request)
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        if self.result_next is not None:
            result, self.result_next = self.result_next, None
            return result  # type: ignore[return-value]
        if request.cancel_token is not None and request.cancel_token.cancelled:
            raise EngineError(EngineErrorKind.CANCELLED, "step cancelled")
        fresh = not decode and request.first_position == 0
        state = _State() if fresh else self.sessions.get(request.session)
        expected = request.expected_past_len if decode else request.first_position
        actual = 0 if state is None else state.past_len
        if state is None or actual != expected:
            raise EngineError(EngineErrorKind.CACHE_MISS, "cache not positioned", actual_past_len=actual)
        if request.token_ids is not None:
            hidden = np.stack(
                [_embed(t, request.first_position + i) for i, t in enumerate(request.token_ids)]
            )
        else:
            assert request.hidden is not None
            hidden = np.array(request.hidden, dtype=np.float32)
        start = (
            request.effective_start_layer
            if request.effective_start_layer is not None
            else self.caps.layer_start
        )
        for layer in range(start, self.caps.layer_end):
            memory = state.memory.get(layer, np.zeros(HIDDEN, dtype=np.float32))
            rows = []
            for row in hidden:
                memory = (memory * np.float32(0.9) + row * np.float32(0.1)).astype(np.float32)
                mixed = np.tanh(row * np.float32(0.3 * (layer + 1)) + memory).astype(np.float32)
                rows.append((row * np.float32(0.5) + mixed * np.float32(0.5)).astype(np.float32))
            hidden = np.stack(rows)
            state.memory[layer] = memory
        state.past_len = request.first_position + request.n_tokens
        self.sessions[request.session] = state
        if self.caps.layer_end < LAYERS:
            return StepResult(
                past_len=state.past_len, cache_hit=not fresh, hidden=hidden, execution_nanos=1000
            )
        token = logits = None
        if request.sampling is not None:
            logits = (_OUT @ hidden[-1]).astype(np.float32)
            token = int(np.argmax(logits))
        return StepResult(
            past_len=state.past_len,
            cache_hit=not fresh,
            token_id=token,
            logits=logits if request.want_logits else None,
            execution_nanos=1000,
        )

    def cancel(self, session: SessionKey) -> int:
        return 0

    def release(self, session: SessionKey) -> bool:
        self.released.append(session)
        return self.sessions.pop(session, None) is not None

    def health(self) -> EngineHealth:
        used = sum(s.past_len for s in self.sessions.values())
        return EngineHealth(
            loaded=True,
            active_sessions=len(self.sessions),
            kv_tokens_used=used,
            kv_tokens_capacity=self.caps.max_context_tokens * self.caps.max_sessions,
            resident_bytes=1234,
        )

    def metrics(self) -> EngineMetrics:
        return EngineMetrics({"prefill_steps": sum(1 for c in self.calls if c.expected_past_len is None)})
