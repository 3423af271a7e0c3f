"""How far a route that mixes GPU and CPU shards agrees with the CPU-only route, greedy.

    python bench/mixed_route.py [--model PATH] [--split L] [--prompt-tokens 64]
                                [--decode-steps 32] [--threads 4] [--gpu-layers 99]

Two in-process engines, [0, L) and [L, n), run one greedy generation per route: both on
the CPU (the reference; bit-exact with the whole model on the CPU, see the parity tests),
head on the GPU and tail on the CPU, head on the CPU and tail on the GPU, and both on the
GPU. Each route is compared with the reference: greedy tokens equal out of N, the first
divergence, the largest |logit difference| before it, and the texts. A CPU and a GPU
compute the same layers in different orders and precisions, so some difference is
expected; how soon it changes a greedy token is what a mixed mesh would see.

On a CUDA build, llama.cpp would also send large batches of a CPU layer's matrix products
to the GPU (its op offload: prefill, not decode); the engine turns op offload off for a
runtime with nothing offloaded (engines/llama_runtime.py), and bench/gpu_check.sh also
raises ``GGML_OP_OFFLOAD_MIN_BATCH`` in case. The value in force is printed.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.engine_chain import greedy_chain
from engines.gguf_info import read_model_info
from engines.interface import LoadRequest
from engines.llama_engine import LlamaShardEngine
from engines.tiny_model import ensure_tiny_model
from engines.tokenizer import Tokenizer


@dataclass(frozen=True)
class Run:
    tokens: list[int]
    logits: list[np.ndarray]
    buffers: list[dict[str, float]]


def _load(path: Path, start: int, end: int | None, gpu_layers: int, threads: int) -> LlamaShardEngine:
    engine = LlamaShardEngine()
    engine.load(
        LoadRequest(
            str(path),
            start,
            end,
            n_ctx=512,
            n_seq_max=1,
            n_batch=128,
            n_threads=threads,
            n_gpu_layers=gpu_layers,
        )
    )
    return engine


def generate(
    path: Path, split: int, placement: tuple[int, int], prompt: tuple[int, ...], steps: int, threads: int
) -> Run:
    chain = [_load(path, 0, split, placement[0], threads), _load(path, split, None, placement[1], threads)]
    logits, tokens = greedy_chain(chain, prompt, steps)
    buffers = [engine.weight_buffers for engine in chain]
    for engine in chain:
        engine.close()
    return Run(tokens, logits, buffers)


def _buffers(buffers: dict[str, float]) -> str:
    return " + ".join(f"{name} {mib:.1f}" for name, mib in sorted(buffers.items()))


def compare(name: str, run: Run, reference: Run, tokenizer: Tokenizer) -> None:
    equal = sum(a == b for a, b in zip(run.tokens, reference.tokens, strict=True))
    first = next(
        (i for i, (a, b) in enumerate(zip(run.tokens, reference.tokens, strict=True)) if a != b), None
    )
    until = len(run.tokens) if first is None else first + 1
    worst = max(
        float(np.abs(a - b).max()) for a, b in zip(run.logits[:until], reference.logits[:until], strict=True)
    )
    total = len(run.tokens)
    if first is None:
        verdict = "identical greedy text"
    else:
        verdict = f"first divergence at token {first} (after the prompt): {run.tokens[first]} vs {reference.tokens[first]}"
    print(f"{name}: tokens equal {equal}/{total}, {verdict}; max |Δlogit| through it {worst:.3g}")
    print(f"  head {_buffers(run.buffers[0])} MiB | tail {_buffers(run.buffers[1])} MiB")
    if first is not None:
        print(f"  text:      {tokenizer.detokenize(run.tokens)[:160]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the generated tiny llama)")
    parser.add_argument("--split", type=int, default=None, help="first layer of the tail (default: half)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--gpu-layers", type=int, default=99, help="n_gpu_layers of a GPU shard (99)")
    args = parser.parse_args()

    path = args.model or ensure_tiny_model()
    info = read_model_info(path)
    split = args.split if args.split is not None else info.n_layers // 2
    high = min(info.vocab_size, 200_000)
    prompt = tuple(
        int(t) for t in np.random.default_rng(7).integers(min(300, high // 4), high, args.prompt_tokens)
    )
    offload_env = os.environ.get("GGML_OP_OFFLOAD_MIN_BATCH", "unset (llama.cpp default 32)")
    print(
        f"{info.name} ({path.name}): [0,{split}) + [{split},{info.n_layers}), {len(prompt)}-token prompt,"
        f" {args.decode_steps} greedy decode steps, GGML_OP_OFFLOAD_MIN_BATCH {offload_env}"
    )
    gpu = args.gpu_layers
    reference = generate(path, split, (0, 0), prompt, args.decode_steps, args.threads)
    with Tokenizer.open(path) as tokenizer:
        print(f"CPU head + CPU tail (reference): text {tokenizer.detokenize(reference.tokens)[:160]!r}")
        for name, placement in (
            ("GPU head + CPU tail", (gpu, 0)),
            ("CPU head + GPU tail", (0, gpu)),
            ("GPU head + GPU tail", (gpu, gpu)),
        ):
            compare(
                name,
                generate(path, split, placement, prompt, args.decode_steps, args.threads),
                reference,
                tokenizer,
            )


if __name__ == "__main__":
    main()
