"""Layer-range shard engines chained in-process against the whole model, same run.

    python bench/engine.py [--rounds 5] [--decode-tokens 64] [--threads 2]

Gemma 3 270M Q4_K_M: the monolithic engine, a two-shard chain [0, 9) + [9, 18) and a
three-shard chain [0, 6) + [6, 12) + [12, 18), all through ``LlamaShardEngine``. For each it
measures a 128-token prefill (fresh session, greedy token sampled at the tail) and greedy
decode ms/token, and prints each as a ratio to the monolithic figure. Configurations
alternate (three prefills per round, then decode blocks of 8 tokens) so that background load hits them
alike; the figures are medians over prefills and over decode blocks.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from engines.default_model import default_model_path
from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest, StepResult
from engines.llama_engine import LlamaShardEngine

PREFILL_TOKENS = 128
BLOCK_TOKENS = 8
PREFILLS_PER_ROUND = 3
CHAINS = {"monolithic": (0, 18), "2 shards": (0, 9, 18), "3 shards": (0, 6, 12, 18)}


def load_chain(path: str, bounds: tuple[int, ...], threads: int) -> list[LlamaShardEngine]:
    chain = []
    for start, end in itertools.pairwise(bounds):
        engine = LlamaShardEngine()
        engine.load(
            LoadRequest(path, start, end, n_ctx=1024, n_seq_max=1, n_batch=PREFILL_TOKENS, n_threads=threads)
        )
        chain.append(engine)
    return chain


def step(
    chain: list[LlamaShardEngine], key: SessionKey, position: int, tokens: tuple[int, ...]
) -> StepResult:
    hidden = None
    for index, engine in enumerate(chain):
        tail = index == len(chain) - 1
        request = StepRequest(
            key,
            position,
            token_ids=tokens if index == 0 else None,
            hidden=hidden,
            expected_past_len=position if position else None,
            sampling=GREEDY if tail else None,
        )
        result = engine.decode(request) if position else engine.prefill(request)
        hidden = result.hidden
    return result


def prefill_seconds(
    chain: list[LlamaShardEngine], key: SessionKey, prompt: tuple[int, ...]
) -> tuple[float, int]:
    started = time.perf_counter()
    token = step(chain, key, 0, prompt).token_id
    assert token is not None
    return time.perf_counter() - started, token


def decode_block(
    chain: list[LlamaShardEngine], key: SessionKey, position: int, token: int, count: int
) -> tuple[float, int]:
    """Seconds per token over ``count`` greedy decode steps, and the last token."""
    started = time.perf_counter()
    for offset in range(count):
        next_token = step(chain, key, position + offset, (token,)).token_id
        assert next_token is not None
        token = next_token
    return (time.perf_counter() - started) / count, token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    path = str(default_model_path())
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(1000, 200_000, size=PREFILL_TOKENS))
    chains = {name: load_chain(path, bounds, args.threads) for name, bounds in CHAINS.items()}
    prefill: dict[str, list[float]] = {name: [] for name in chains}
    decode: dict[str, list[float]] = {name: [] for name in chains}
    blocks = max(1, args.decode_tokens // BLOCK_TOKENS)
    for rnd in range(-1, args.rounds):  # round -1 warms up: page faults, graph allocation
        key = SessionKey(f"bench-{rnd}", 1)
        tokens = {}
        for _ in range(PREFILLS_PER_ROUND):  # a prefill at position 0 restarts the session
            for name, chain in chains.items():
                seconds, tokens[name] = prefill_seconds(chain, key, prompt)
                if rnd >= 0:
                    prefill[name].append(seconds)
        # Alternate short decode blocks so background load hits every configuration alike.
        for block in range(blocks):
            for name, chain in chains.items():
                seconds, tokens[name] = decode_block(
                    chain, key, len(prompt) + block * BLOCK_TOKENS, tokens[name], BLOCK_TOKENS
                )
                if rnd >= 0:
                    decode[name].append(seconds)
        for chain in chains.values():
            for engine in chain:
                engine.release(key)

    base_prefill, base_decode = (
        statistics.median(prefill["monolithic"]),
        statistics.median(decode["monolithic"]),
    )
    print(f"Gemma 3 270M Q4_K_M, {args.threads} threads, {args.rounds} rounds, medians")
    print(f"{'configuration':<14} {'prefill 128 (s)':>16} {'ratio':>7} {'decode ms/token':>16} {'ratio':>7}")
    for name in chains:
        p, d = statistics.median(prefill[name]), statistics.median(decode[name])
        print(f"{name:<14} {p:>16.4f} {p / base_prefill:>6.3f}x {d * 1000:>16.2f} {d / base_decode:>6.3f}x")
    for chain in chains.values():
        for engine in chain:
            engine.close()


if __name__ == "__main__":
    main()
