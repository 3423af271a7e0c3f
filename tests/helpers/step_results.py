"""What a test reads from an engine step that it asked to sample or to return logits.

``StepResult.token_id`` and ``.logits`` are optional (a hop that does not sample has none); a
test that asked for them reads them here, so a step that lacks one fails at the read.
"""

from __future__ import annotations

import numpy as np

from engines.interface import StepResult


def sampled_token(result: StepResult) -> int:
    assert result.token_id is not None, "the step sampled no token"
    return result.token_id


def step_logits(result: StepResult) -> np.ndarray:
    assert result.logits is not None, "the step returned no logits"
    return result.logits
