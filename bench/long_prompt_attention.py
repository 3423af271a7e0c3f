"""What a long prompt's attention costs a CPU node, against stock llama.cpp, same run.

    python bench/long_prompt_attention.py [--prompt-tokens 4096] [--layers 2] [--threads 1]
                                          [--decode 16] [--configs stock,stock-128,meshnode,...]

Issue 53's 8B run took 2.04x monolithic llama.cpp's time to first token on a 4096-token
prompt and 0.94x on a 1024-token one. This bench isolates the attention: Llama 3 8B's shape
(bench/random_model.py's ``llama3-8b``) cut to ``--layers`` layers, so a 4096-token prefill
takes a minute, one context per configuration, the same tokens:

- ``stock`` (the baseline every ratio is against): ``llama_context_default_params()`` as
  llama-cli, llama-server and bench/e2e.py's ``Monolithic`` run it: K and V f16, flash
  attention auto (on, on a CPU), 512-token passes.
- ``stock-128``: the same in 128-token passes (the mesh's prefill grid), so the pass size's
  share is told apart from the KV types'.
- ``meshnode``: ``engines.llama_runtime.LlamaRuntime`` unchanged: K f16, V bf16, flash
  attention on, 128-token passes.
- ``k-bf16``, ``k-q8_0``: K bf16 or Q8_0 with V f16, 128-token passes: types that stay apart,
  so they would keep meshnode's bit-exact batches and verify steps (engines/row_invariance.py),
  for the record of what they would save. Their accuracy is not measured here.

Why the types matter: ggml-cpu's flash attention tiles passes of many query rows
(``ggml_compute_forward_flash_attn_ext_tiled``) and splits a lone row's KV across threads,
both only when K and V share a type; meshnode keeps them apart so that a decode rounds the
same alone, batched and as a verify row, and then every pass attends one query row at a
time over every cached position, converting each cached V row from bf16 with a scalar loop.
An f32 K or V would not help: llama.cpp casts an f32 cache to f16 before flash attention,
and the types meet again.

Time is the process's CPU seconds (``time.process_time``): with ``--threads 1`` (the default)
that is the work itself, unmoved by whatever else a shared machine runs; with more threads the
wall-clock times are printed too (CPU time then counts every thread's waiting as well). Printed: prefill CPU
seconds at each 1024 tokens, decode ms a token at the prompt's depth over ``--decode``
tokens, and each against ``stock``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import llama_cpp  # noqa: E402
from random_model import RANDOM_MODEL_VERSION, SIZES, write_random_model  # noqa: E402

import engines.llama_runtime as llama_runtime  # noqa: E402
from engines.atomic_files import atomic_path  # noqa: E402
from engines.cache import cache_root  # noqa: E402

GRID = 128
STOCK_BATCH = 512
# ggml_type GGML_TYPE_BF16 (llama-cpp-python exports no name for it).
GGML_TYPE_BF16 = 30


@dataclass(frozen=True)
class Config:
    name: str
    batch: int
    # Context fields set over the runtime's own (None: the runtime's choice, unchanged).
    type_k: int | None = None
    type_v: int | None = None
    flash_attn_type: int | None = None


CONFIGS = {
    config.name: config
    for config in (
        Config(
            "stock",
            STOCK_BATCH,
            llama_cpp.GGML_TYPE_F16,
            llama_cpp.GGML_TYPE_F16,
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
        ),
        Config(
            "stock-128",
            GRID,
            llama_cpp.GGML_TYPE_F16,
            llama_cpp.GGML_TYPE_F16,
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
        ),
        Config("meshnode", GRID),
        Config(
            "k-bf16", GRID, GGML_TYPE_BF16, llama_cpp.GGML_TYPE_F16, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ),
        Config(
            "k-q8_0",
            GRID,
            llama_cpp.GGML_TYPE_Q8_0,
            llama_cpp.GGML_TYPE_F16,
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        ),
    )
}


@dataclass
class Result:
    prefill_marks: list[tuple[int, float]]
    decode_ms: float
    # Wall-clock time, for runs with more than one thread (CPU time then counts every thread,
    # spinning included).
    prefill_wall_s: float
    decode_wall_ms: float


def model_with_layers(layers: int) -> Path:
    """The 8B shape cut to ``layers`` layers, generated once into the model cache."""
    path = (
        cache_root()
        / "models"
        / f"meshnode-random-llama-llama3-8b-{layers}layers-v{RANDOM_MODEL_VERSION}.gguf"
    )
    if not path.exists():
        shape = dataclasses.replace(SIZES["llama3-8b"], n_layers=layers)
        with atomic_path(path) as temporary:
            write_random_model(temporary, shape, f"meshnode random llama (llama3-8b, {layers} layers)")
    return path


@contextlib.contextmanager
def context_fields(config: Config) -> Iterator[None]:
    """The runtime's context with ``config``'s fields set over its own."""
    original = llama_cpp.llama_init_from_model

    def init(model: object, params: llama_cpp.llama_context_params) -> object:
        for field in ("type_k", "type_v", "flash_attn_type"):
            value = getattr(config, field)
            if value is not None:
                setattr(params, field, value)
        return original(model, params)

    llama_runtime.llama_cpp.llama_init_from_model = init
    try:
        yield
    finally:
        llama_runtime.llama_cpp.llama_init_from_model = original


def measure(
    model: Path, config: Config, tokens: np.ndarray, prompt: int, decode: int, threads: int
) -> Result:
    with context_fields(config):
        runtime = llama_runtime.LlamaRuntime(
            model,
            n_ctx=prompt + decode + 256,
            n_seq_max=1,
            n_batch=config.batch,
            n_threads=threads,
            n_gpu_layers=0,
            takes_embeddings=False,
            weight_repack=True,
            capture_layer=None,
        )
    try:
        marks = []
        wall_started = time.perf_counter()
        started = time.process_time()
        for start in range(0, prompt, config.batch):
            end = min(prompt, start + config.batch)
            runtime.run(0, start, tokens[start:end], want_logits=end == prompt)
            if end % 1024 == 0 or end == prompt:
                marks.append((end, time.process_time() - started))
        prefill_wall_s = time.perf_counter() - wall_started
        decoding = time.process_time()
        wall_decoding = time.perf_counter()
        for offset in range(decode):
            position = prompt + offset
            runtime.run(0, position, tokens[position : position + 1], want_logits=True)
        decode_ms = (time.process_time() - decoding) / max(1, decode) * 1000
        decode_wall_ms = (time.perf_counter() - wall_decoding) / max(1, decode) * 1000
    finally:
        runtime.close()
    return Result(marks, decode_ms, prefill_wall_s, decode_wall_ms)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2, help="of the 8B shape's 32 (2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode", type=int, default=16, help="tokens decoded at the prompt's depth (16)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    names = [name for name in args.configs.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if "stock" not in names:
        names.insert(0, "stock")
    model = model_with_layers(args.layers)
    tokens = (
        np.random.default_rng(53).integers(100, 120_000, args.prompt_tokens + args.decode).astype(np.int32)
    )
    print(
        f"model: {model.name} ({model.stat().st_size / 1e9:.2f} GB), {args.prompt_tokens}-token prompt, "
        f"{args.threads} thread(s), CPU seconds of this process",
        flush=True,
    )
    results: dict[str, Result] = {}
    for name in names:
        result = measure(model, CONFIGS[name], tokens, args.prompt_tokens, args.decode, args.threads)
        results[name] = result
        base = results["stock"]
        marks = ", ".join(
            f"{end}: {cpu:.1f} s ({cpu / base_cpu:.2f}x)"
            for (end, cpu), (_, base_cpu) in zip(result.prefill_marks, base.prefill_marks, strict=True)
        )
        print(
            f"  {name:10s} prefill {marks}; decode at {args.prompt_tokens}: {result.decode_ms:.1f} ms a token "
            f"({result.decode_ms / base.decode_ms:.2f}x)",
            flush=True,
        )
        if args.threads > 1:
            print(
                f"  {'':10s} wall: prefill {result.prefill_wall_s:.1f} s "
                f"({result.prefill_wall_s / base.prefill_wall_s:.2f}x), decode {result.decode_wall_ms:.1f} ms a "
                f"token ({result.decode_wall_ms / base.decode_wall_ms:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
