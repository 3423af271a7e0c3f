"""What the CPU engine's KV cache types cost in accuracy, against stock llama.cpp, same run.

    python bench/kv_precision.py [--tokens 1024] [--text PATH] [--threads 2] [--model PATH]
                                 [--continuations 64]

On a CPU, ``LlamaShardEngine`` keeps K in f16 and V in bf16 with flash attention on
(engines/llama_runtime.py), so that a session's logits are bit for bit the same alone, in a
batch of sessions and as a verify row (bench/RESULTS.md, issue 20). Stock llama.cpp keeps
both in f16. bf16 has 8 bits of mantissa where f16 has 11, so meshnode's text can part from
llama.cpp's where two tokens nearly tie. This bench says how much, on one model and text:

- ``f32 KV``: llama.cpp with K and V in f32, flash attention off: the reference.
- ``stock llama.cpp``: ``llama_context_default_params()`` (K and V f16, flash attention auto,
  as llama-cli and llama-server run): the baseline each ratio is against.
- ``llama-cpp-python``: what its ``Llama()`` runs by default: K and V f16, flash attention off.
- ``meshnode``: the whole model through ``LlamaShardEngine``, as a node serves it.

All three read the same text (default: this repository's README.md, its first ``--tokens``
tokens) one token per ``llama_decode``, as decoding does, in lockstep, with the same weights
(no weight repack anywhere). Per configuration: perplexity of the text, its ratio to stock,
how often its most likely next token is the reference's and stock's, and the largest and
median (over positions) largest logit difference from the reference. Then each greedy continuation of ``--continuations`` tokens from a few
prompts, and where it first parts from stock llama.cpp's. Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from one_sequence_batch import fill_one_sequence

from engines.default_model import default_model_path
from engines.interface import GREEDY, LoadRequest, SessionKey, StepRequest
from engines.llama_engine import LlamaShardEngine
from engines.llama_lib import ensure_llama_backend
from engines.tokenizer import Tokenizer

REFERENCE = "f32 KV"
BASELINE = "stock llama.cpp"
BINDING = "llama-cpp-python"
ENGINE = "meshnode"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):",
    "<start_of_turn>user\nBe brief.\n\nSay hello<end_of_turn>\n<start_of_turn>model\n",
]
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "README.md"


class PlainContext:
    """A whole model in a llama.cpp context of chosen KV types, fed one or more tokens a call."""

    def __init__(
        self, model: ctypes.c_void_p, n_ctx: int, threads: int, *, kv_type: int | None, flash_attn: int | None
    ) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = n_ctx
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        if kv_type is not None:
            params.type_k = kv_type
            params.type_v = kv_type
        if flash_attn is not None:
            params.flash_attn_type = flash_attn
        self._ctx = llama_cpp.llama_init_from_model(model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def forward(self, first_position: int, tokens: list[int]) -> np.ndarray:
        """The logits after the last of ``tokens``, placed from ``first_position``."""
        fill_one_sequence(self._batch, tokens, first_position)
        if llama_cpp.llama_decode(self._ctx, self._batch) != 0:
            raise RuntimeError(f"llama_decode failed at position {first_position}")
        row = llama_cpp.llama_get_logits_ith(self._ctx, len(tokens) - 1)
        return np.ctypeslib.as_array(row, shape=(self._n_vocab,)).copy()

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)


class EngineContext:
    """The whole model as a meshnode node computes it: ``LlamaShardEngine``'s steps."""

    def __init__(self, model_path: Path, n_ctx: int, threads: int) -> None:
        self._engine = LlamaShardEngine()
        self._engine.load(LoadRequest(str(model_path), 0, None, n_ctx=n_ctx, n_seq_max=1, n_threads=threads))
        self._session = 0
        self._key = SessionKey("kv-precision", 1)

    def forward(self, first_position: int, tokens: list[int]) -> np.ndarray:
        request = StepRequest(
            self._key,
            first_position,
            token_ids=tuple(tokens),
            expected_past_len=first_position if first_position else None,
            sampling=GREEDY,
            want_logits=True,
        )
        step = self._engine.prefill(request) if first_position == 0 else self._engine.decode(request)
        assert step.logits is not None
        return np.asarray(step.logits, dtype=np.float32).ravel()

    def clear(self) -> None:
        self._engine.release(self._key)
        self._session += 1
        self._key = SessionKey("kv-precision", self._session + 1)

    def close(self) -> None:
        self._engine.close()


@dataclass
class Scores:
    """One configuration's record over the text, against the reference."""

    nll: list[float] = field(default_factory=list)
    top_agrees: int = 0
    baseline_top_agrees: int = 0
    worst_difference: float = 0.0
    differences: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def perplexity(self) -> float:
        return math.exp(statistics.fmean(self.nll))


def negative_log_likelihood(logits: np.ndarray, target: int) -> float:
    wide = logits.astype(np.float64)
    top = wide.max()
    return float(top + math.log(np.exp(wide - top).sum()) - wide[target])


def score_text(contexts: dict[str, PlainContext | EngineContext], tokens: list[int]) -> dict[str, Scores]:
    scores = {name: Scores() for name in contexts}
    for position, token in enumerate(tokens[:-1]):
        logits = {}
        for name, context in contexts.items():
            started = time.perf_counter()
            logits[name] = context.forward(position, [token])
            scores[name].seconds += time.perf_counter() - started
        reference = logits[REFERENCE]
        reference_top = int(reference.argmax())
        baseline_top = int(logits[BASELINE].argmax())
        for name, row in logits.items():
            record = scores[name]
            record.nll.append(negative_log_likelihood(row, tokens[position + 1]))
            top = int(row.argmax())
            record.top_agrees += top == reference_top
            record.baseline_top_agrees += top == baseline_top
            difference = float(np.abs(row - reference).max())
            record.differences.append(difference)
            record.worst_difference = max(record.worst_difference, difference)
    return scores


def greedy_text(context: PlainContext | EngineContext, prompt: list[int], count: int) -> list[int]:
    context.clear()
    generated = [int(context.forward(0, prompt).argmax())]
    while len(generated) < count:
        generated.append(int(context.forward(len(prompt) + len(generated) - 1, [generated[-1]]).argmax()))
    return generated


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the text scored (default 1024)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text (default: README.md)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--continuations", type=int, default=64, help="greedy tokens per prompt (0: none)")
    args = parser.parse_args()

    model_path = args.model or default_model_path()
    tokenizer = Tokenizer.open(model_path)
    tokens = tokenizer.tokenize(args.text.read_text())[: args.tokens]
    prompts = [tokenizer.tokenize(p, parse_special=True) for p in PROMPTS]
    n_ctx = max(len(tokens), max(map(len, prompts)) + args.continuations) + 8

    ensure_llama_backend()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
    off = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    contexts: dict[str, PlainContext | EngineContext] = {
        REFERENCE: PlainContext(model, n_ctx, args.threads, kv_type=llama_cpp.GGML_TYPE_F32, flash_attn=off),
        BASELINE: PlainContext(model, n_ctx, args.threads, kv_type=None, flash_attn=None),
        BINDING: PlainContext(model, n_ctx, args.threads, kv_type=None, flash_attn=off),
        ENGINE: EngineContext(model_path, n_ctx, args.threads),
    }
    print(f"model {model_path.name}, {len(tokens)} tokens of {args.text.name}, {args.threads} threads")
    print(llama_cpp.llama_print_system_info().decode().strip())
    try:
        scores = score_text(contexts, tokens)
        baseline = scores[BASELINE].perplexity()
        print(f"\n{'':16} {'perplexity':>10} {'vs stock':>9} {'top-1 = f32':>12} {'= stock':>8} "
              f"{'max |dlogit|':>13} {'median':>8} {'ms/token':>9}")  # fmt: skip
        for name, record in scores.items():
            steps = len(record.nll)
            print(
                f"{name:16} {record.perplexity():10.4f} {record.perplexity() / baseline:8.4f}x "
                f"{record.top_agrees / steps:11.2%} {record.baseline_top_agrees / steps:8.2%} "
                f"{record.worst_difference:13.4f} "
                f"{statistics.median(record.differences):8.4f} {1000 * record.seconds / steps:9.2f}"
            )
        if args.continuations:
            print(f"\ngreedy continuations, {args.continuations} tokens: where each first parts from stock")
            for prompt_text, prompt in zip(PROMPTS, prompts, strict=True):
                texts = {name: greedy_text(c, prompt, args.continuations) for name, c in contexts.items()}
                parts = {
                    name: first_difference(texts[name], texts[BASELINE]) for name in texts if name != BASELINE
                }
                said = ", ".join(
                    f"{name}: {'same' if at is None else f'token {at}'}" for name, at in parts.items()
                )
                print(f"  {prompt_text!r:60.60} {said}")
    finally:
        for context in contexts.values():
            context.close()
        llama_cpp.llama_model_free(model)
        tokenizer.close()


if __name__ == "__main__":
    main()
