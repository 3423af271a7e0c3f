"""Batched decode against solo decode on one shard: the harness ``test_engine_batch.py`` runs.

Two engines load the same layer range. The solo engine decodes every session alone; the batch
engine decodes all of them each step in one ``step_batch``. Both see the same inputs: token ids
on a head shard, and on any other shard the hidden states a solo ``[0, start)`` head computed
for the same tokens. Sessions sit in the batch engine's slots as a ``layout`` says, so a batch
can skip slots: ``"s"`` is a batched session, ``"live"`` a session that holds cache but is not
in the batch (a gap whose stream llama.cpp must leave exactly as it was), ``"hole"`` a slot
opened and released again (an empty gap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from engines.engine_probe import ProbeTarget, probe
from engines.interface import (
    GREEDY,
    BatchStep,
    EngineError,
    LoadRequest,
    SessionKey,
    StepRequest,
    StepResult,
)
from engines.llama_engine import LlamaShardEngine


def load(
    path: Path, start: int, end: int | None, *, n_seq_max: int = 6, n_ctx: int = 512
) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(str(path), start, end, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=256, n_threads=2)
    )
    return engine


@dataclass
class Stream:
    """One session's tokens, prompt then one decode token per step, and the shard's inputs for them."""

    key: SessionKey
    prompt: tuple[int, ...]
    decodes: tuple[int, ...]
    prefill_hidden: np.ndarray | None = None
    decode_hidden: list[np.ndarray] = field(default_factory=list)

    def prefill(self, tail: bool, key: SessionKey | None = None) -> StepRequest:
        key = self.key if key is None else key
        if self.prefill_hidden is None:
            return StepRequest(key, 0, token_ids=self.prompt, want_logits=tail)
        return StepRequest(key, 0, hidden=self.prefill_hidden, want_logits=tail)

    def decode(self, step: int, tail: bool) -> StepRequest:
        position = len(self.prompt) + step
        if self.prefill_hidden is None:
            tokens: tuple[int, ...] | None = (self.decodes[step],)
            hidden = None
        else:
            tokens, hidden = None, self.decode_hidden[step]
        return StepRequest(
            self.key,
            position,
            token_ids=tokens,
            hidden=hidden,
            expected_past_len=position,
            sampling=GREEDY if tail else None,
            want_logits=tail,
        )


def feed(path: Path, start: int, streams: Sequence[Stream]) -> None:
    """Give a non-head shard its inputs: what a solo ``[0, start)`` head computes for each stream."""
    if start == 0:
        return
    head = load(path, 0, start)
    try:
        for stream in streams:
            result = head.prefill(StepRequest(stream.key, 0, token_ids=stream.prompt))
            stream.prefill_hidden = result.hidden
            for step, token in enumerate(stream.decodes):
                position = len(stream.prompt) + step
                request = StepRequest(stream.key, position, token_ids=(token,), expected_past_len=position)
                stream.decode_hidden.append(head.decode(request).hidden)
            head.release(stream.key)
    finally:
        head.close()


@dataclass
class ParityReport:
    # Largest |batched - solo| over every hidden element (non-tail) or logit (tail) of every step.
    max_abs_diff: float = 0.0
    # Tail: (session, step) pairs whose greedy token differs.
    token_mismatches: list[tuple[int, int]] = field(default_factory=list)
    # Whether each live gap session's next decode after the batches equals its solo twin's.
    gaps_untouched: bool = True
    compared: int = 0


def _difference(a: StepResult, b: StepResult) -> float:
    if a.hidden is not None:
        assert b.hidden is not None and a.hidden.shape == b.hidden.shape
        return float(np.abs(a.hidden - b.hidden).max())
    assert a.logits is not None and b.logits is not None
    return float(np.abs(a.logits - b.logits).max())


def batch_vs_solo(
    path: Path,
    start: int,
    end: int | None,
    total_layers: int,
    streams: Sequence[Stream],
    layout: Sequence[str],
    *,
    n_seq_max: int = 6,
) -> ParityReport:
    """Decode ``streams`` (as many as ``layout`` has ``"s"``) solo and batched; compare every step."""
    tail = end is None or end == total_layers
    batched = list(streams)
    assert len(batched) == layout.count("s")
    steps = min(len(stream.decodes) for stream in batched)
    # Gap sessions replay the first stream's prompt under their own keys.
    first = batched[0]
    gaps = [
        Stream(
            SessionKey(f"gap-{index}", 1),
            first.prompt,
            first.decodes,
            first.prefill_hidden,
            first.decode_hidden,
        )
        for index, kind in enumerate(layout)
        if kind == "live"
    ]
    solo, batch = load(path, start, end, n_seq_max=n_seq_max), load(path, start, end, n_seq_max=n_seq_max)
    report = ParityReport()
    try:
        # Open the batch engine's sessions slot by slot (a session takes the lowest free slot).
        queue, gap_queue, holes = list(batched), list(gaps), []
        for index, kind in enumerate(layout):
            stream = queue.pop(0) if kind == "s" else gap_queue.pop(0) if kind == "live" else None
            if stream is None:
                hole = SessionKey(f"hole-{index}", 1)
                batch.prefill(first.prefill(tail, hole))
                holes.append(hole)
            else:
                solo_result = solo.prefill(stream.prefill(tail))
                batch_result = batch.prefill(stream.prefill(tail))
                report.max_abs_diff = max(report.max_abs_diff, _difference(batch_result, solo_result))
        for hole in holes:
            assert batch.release(hole)

        for step in range(steps):
            expected = [solo.decode(stream.decode(step, tail)) for stream in batched]
            outcomes = batch.step_batch([BatchStep(stream.decode(step, tail), True) for stream in batched])
            for index, (outcome, alone) in enumerate(zip(outcomes, expected, strict=True)):
                if isinstance(outcome, EngineError):
                    raise outcome
                report.max_abs_diff = max(report.max_abs_diff, _difference(outcome, alone))
                report.compared += 1
                if tail and outcome.token_id != alone.token_id:
                    report.token_mismatches.append((index, step))
        for gap in gaps:
            request = gap.decode(0, tail)
            report.gaps_untouched &= _difference(batch.decode(request), solo.decode(request)) == 0.0
    finally:
        solo.close()
        batch.close()
    return report


def greedy_texts(
    engine: LlamaShardEngine, prompts: Sequence[tuple[int, ...]], steps: int, *, batched: bool
) -> list[list[int]]:
    """Whole-model greedy generation of every prompt, all sessions a step in one ``step_batch``
    (``batched``) or each session alone."""
    keys = [SessionKey(f"{'batch' if batched else 'solo'}-{index}", 1) for index in range(len(prompts))]
    tokens: list[list[int]] = []
    for key, prompt in zip(keys, prompts, strict=True):
        result = engine.prefill(StepRequest(key, 0, token_ids=prompt, sampling=GREEDY))
        assert result.token_id is not None
        tokens.append([result.token_id])
    for step in range(steps):
        requests = [
            StepRequest(
                key,
                len(prompt) + step,
                token_ids=(generated[-1],),
                expected_past_len=len(prompt) + step,
                sampling=GREEDY,
            )
            for key, prompt, generated in zip(keys, prompts, tokens, strict=True)
        ]
        if batched:
            results = engine.step_batch([BatchStep(request, True) for request in requests])
        else:
            results = [engine.decode(request) for request in requests]
        for generated, result in zip(tokens, results, strict=True):
            if isinstance(result, EngineError):
                raise result
            assert result.token_id is not None
            generated.append(result.token_id)
    for key in keys:
        engine.release(key)
    return tokens


def skip_unless_repacked_weights_run(model: Path, cache_dir: Path, threads: int = 2) -> None:
    """Skip where llama.cpp cannot run ``model`` with repacked weights (its probe crashed: an AMX CPU)."""
    verdict = probe(ProbeTarget(model, weight_repack=True, threads=threads, cache_dir=cache_dir))
    if not verdict.survived:
        pytest.skip(f"llama.cpp cannot run repacked weights on this CPU: {verdict.detail}")
