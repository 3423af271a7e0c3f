"""Test-only engines that compute wrong on purpose, for audits to catch. Nothing shipped can lie.

:class:`LyingEngine` perturbs, at random (seeded) on one step in ``lie_every``, one element of
the hidden states it passes on by one unit in the last place; :class:`LayerSkippingEngine`
passes its input on as if its first layer were not there (a node skipping work to look fast).
Both keep their own caches honest, and the worker signs what they return, as it would any
engine's output.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from engines.interface import BatchStep, StepOutcome, StepResult
from helpers.recording_engine import RecordingEngine


class LyingEngine(RecordingEngine):
    def __init__(
        self, layer_start: int, layer_end: int, *, lie_every: int = 20, seed: int = 0, **options: object
    ) -> None:
        super().__init__(layer_start, layer_end, **options)  # type: ignore[arg-type]
        self.lie_every = lie_every
        self._rng = random.Random(seed)
        self.lies = 0

    def _maybe_lie(self, outcome: StepOutcome) -> StepOutcome:
        if not isinstance(outcome, StepResult) or outcome.hidden is None:
            return outcome
        if self._rng.randrange(self.lie_every):
            return outcome
        self.lies += 1
        hidden = outcome.hidden.copy()
        row, column = self._rng.randrange(hidden.shape[0]), self._rng.randrange(hidden.shape[1])
        hidden[row, column] = np.nextafter(hidden[row, column], np.float32(np.inf))
        return replace(outcome, hidden=hidden)

    def step_batch(self, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        return [self._maybe_lie(outcome) for outcome in super().step_batch(steps)]


class LayerSkippingEngine(RecordingEngine):
    """Serves a range of one layer and skips it: what it passes on is what it was given."""

    def step_batch(self, steps: Sequence[BatchStep]) -> list[StepOutcome]:
        outcomes = super().step_batch(steps)
        skipped: list[StepOutcome] = []
        for step, outcome in zip(steps, outcomes, strict=True):
            if (
                isinstance(outcome, StepResult)
                and outcome.hidden is not None
                and step.request.hidden is not None
            ):
                outcome = replace(outcome, hidden=np.array(step.request.hidden, dtype=np.float32))
            skipped.append(outcome)
        return skipped


__all__ = ["LayerSkippingEngine", "LyingEngine"]
