"""``engines.fake.FakeEngine``, loaded on a small model, with every step recorded.

The fake engine provides the model math, cache semantics and its own fault rules;
this subclass adds what protocol tests need on top: the list of step requests the
worker made (a batch's in its order), the batches (``batches``: each one's steps), the
sessions it released, and ``fail_next`` to make the next step raise an arbitrary
exception (any ``EngineError`` kind, or text with a path in it); within a batch the
exception fails the whole ``step_batch`` call, as an engine crashing mid-batch would.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.fake import FAKE_NUMERICS, FakeEngine, FakeModelSpec
from engines.interface import BatchStep, LoadRequest, SessionKey, StepOutcome, StepRequest, StepResult

HIDDEN = 8
VOCAB = 32
LAYERS = 4
SPEC = FakeModelSpec(total_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, seed=7, name="dataplane-test")


class RecordingEngine(FakeEngine):
    def __init__(
        self,
        layer_start: int = 0,
        layer_end: int = LAYERS,
        *,
        max_sessions: int = 4,
        max_context: int = 64,
        numerics: str = FAKE_NUMERICS,
        prefix_cache_entries: int = 0,
        exact_numerics: bool = True,
    ) -> None:
        super().__init__(SPEC, numerics=numerics, exact_numerics=exact_numerics)
        self.load(
            LoadRequest(
                model_path="",
                layer_start=layer_start,
                layer_end=layer_end,
                n_ctx=max_context,
                n_seq_max=max_sessions,
                prefix_cache_entries=prefix_cache_entries,
            )
        )
        self.calls: list[StepRequest] = []
        self.batches: list[tuple[BatchStep, ...]] = []
        self.released: list[SessionKey] = []
        self.fail_next: BaseException | None = None
        self._in_batch = False

    def prefill(self, request: StepRequest) -> StepResult:
        self._record(request)
        return super().prefill(request)

    def decode(self, request: StepRequest) -> StepResult:
        self._record(request)
        return super().decode(request)

    def step_batch(self, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        self.batches.append(tuple(steps))
        for step in steps:
            self._record(step.request)
        # The engine's own batch path may run the steps through prefill/decode (recorded above).
        self._in_batch = True
        try:
            return super().step_batch(steps)
        finally:
            self._in_batch = False

    def release(self, session: SessionKey) -> bool:
        self.released.append(session)
        return super().release(session)

    def _record(self, request: StepRequest) -> None:
        if self._in_batch:
            return
        self.calls.append(request)
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
