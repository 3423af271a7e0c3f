"""Decode throughput of ``step_batch``: k sessions' one-token decodes in one ``llama_decode``.

    python bench/engine_batch.py [--ks 1,2,4,8] [--rounds 5] [--block 16] [--threads 2] [--model PATH]

One whole-model ``LlamaShardEngine`` (default: Gemma 3 270M Q4_K_M, weight repack off) holds
``max(ks)`` sessions, each prefilled with its own short prompt. Each round gives every k a block
of ``--block`` greedy decode steps (all k sessions per ``step_batch``), k after k, so background
load hits them alike; a session's cache is rolled back after its block (release and prefill
again) so every k decodes at the same positions. Prints tokens/s (k x steps / seconds, median
over rounds, and
the best block) and the ratio to k = 1 in the same run. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from engines.default_model import default_model_path
from engines.interface import GREEDY, BatchStep, EngineError, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "Explain in one sentence why the sky is blue:",
    "A list of prime numbers: 2, 3, 5,",
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1969 the first people to walk on the Moon",
    "Three things every good bread needs are",
]


def _prefill(engine: LlamaShardEngine, keys: list[SessionKey], prompts: list[tuple[int, ...]]) -> list[int]:
    first = []
    for key, prompt in zip(keys, prompts, strict=True):
        engine.release(key)
        result = engine.prefill(StepRequest(key, 0, token_ids=prompt, sampling=GREEDY))
        assert result.token_id is not None
        first.append(result.token_id)
    return first


def _block(
    engine: LlamaShardEngine, keys: list[SessionKey], prompts: list[tuple[int, ...]], steps: int
) -> float:
    """Seconds for ``steps`` batched greedy decodes of every session, from a fresh prefill."""
    last = _prefill(engine, keys, prompts)
    started = time.perf_counter()
    for step in range(steps):
        requests = [
            StepRequest(
                key,
                len(prompt) + step,
                token_ids=(token,),
                expected_past_len=len(prompt) + step,
                sampling=GREEDY,
            )
            for key, prompt, token in zip(keys, prompts, last, strict=True)
        ]
        outcomes = engine.step_batch([BatchStep(request, True) for request in requests])
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, EngineError):
                raise outcome
            assert outcome.token_id is not None
            last[index] = outcome.token_id
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    path = args.model or default_model_path(progress=False)

    with Tokenizer.open(path) as tokenizer:
        prompts = [tuple(tokenizer.tokenize(PROMPTS[i % len(PROMPTS)])) for i in range(max(ks))]
    engine = LlamaShardEngine()
    engine.load(LoadRequest(str(path), n_ctx=256, n_seq_max=max(ks), n_batch=256, n_threads=args.threads))
    keys = [SessionKey(f"bench-{index}", 1) for index in range(max(ks))]
    try:
        _block(engine, keys[:1], prompts[:1], 4)  # warm up
        seconds: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(args.rounds):
            for k in ks:
                seconds[k].append(_block(engine, keys[:k], prompts[:k], args.block))
    finally:
        engine.close()

    # The median is the figure; the best block shows what background load took from it.
    median = {k: k * args.block / statistics.median(seconds[k]) for k in ks}
    best = {k: k * args.block / min(seconds[k]) for k in ks}
    print(f"{path.name}, {args.threads} threads, {args.rounds} rounds of {args.block} steps")
    for k in ks:
        print(
            f"k={k}: {median[k]:7.1f} tokens/s median ({median[k] / median[ks[0]]:.2f}x k={ks[0]}), "
            f"{best[k]:7.1f} best ({best[k] / best[ks[0]]:.2f}x)"
        )


if __name__ == "__main__":
    main()
