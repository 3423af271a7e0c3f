"""A random-weight llama-architecture GGUF for timing shard engines where Gemma cannot go.

    python bench/random_model.py [--size large|small|gemma270m] [--directory DIR]

Prints the path of the model, generating it first if it is not cached. ``large`` (the
GPU bench's): 12 layers, n_embd 2048, n_ff 5632, 16 heads (4 KV heads), a 32 000-token
vocabulary, float16 weights, about 1.35 GB — enough weight traffic per token for a GPU's
decode time to be more than launch overhead. ``small`` (the CPU dry run's): the same shape
scaled down, about 40 MB. ``gemma270m``: Gemma 3 270M's shape (18 layers, n_embd 640, n_ff 2048,
4 heads with 1 KV head, a 262 144-token vocabulary) as a llama with Gemma's weight types where
gguf-py can write them (Q8_0 vocabulary tables, Q5_0 layer matrices where Gemma mixes Q5_0, Q4_K,
Q6_K and Q8_0), about 0.5 GB: the concurrency bench's stand-in where the Gemma package cannot go
(a machine without the package registries), with the same layer count and the vocabulary
projection dominating a token's work; tokens/s compare only within one run.

Generated in seconds: each weight matrix is a window of a pre-scaled pool of float16
normal values (an odd length, so no two rows of a matrix are equal and no two tokens tie),
so making the model costs memory copies, not random draws. The numbers are meaningless;
the shapes, the dtype and the tokenizer (byte fallback, so any text tokenizes) are real,
and the bytes are deterministic.
"""

from __future__ import annotations

import argparse
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

from engines.atomic_files import atomic_path
from engines.cache import cache_root

RANDOM_MODEL_VERSION = 1
_SEED = 20261201
# Odd, so a window of it reshaped to (rows, cols) with cols a power of two never repeats a row.
_POOL = (1 << 24) + 1


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    context: int = 4096
    # Gemma 3 270M Q4_K_M's kinds of weights (Q8_0 tables, Q5_0 matrices) instead of float16:
    # llama.cpp's batched kernels, and so how a shard batches sessions, depend on the type.
    quantized: bool = False


SIZES = {
    "large": Shape(n_layers=12, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=4, n_vocab=32000),
    "small": Shape(n_layers=6, n_embd=512, n_ff=1408, n_head=8, n_head_kv=2, n_vocab=8000),
    "gemma270m": Shape(
        n_layers=18, n_embd=640, n_ff=2048, n_head=4, n_head_kv=1, n_vocab=262_144, quantized=True
    ),
}


def _vocabulary(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style: control tokens, 256 byte-fallback tokens, letters, then filler."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [int(TokenType.BYTE)] * 256
    pieces = ["▁", *string.ascii_letters, *string.digits, *".,!?'-:;()"]
    pieces += ["▁" + letter for letter in string.ascii_lowercase]
    tokens += pieces
    types += [int(TokenType.NORMAL)] * len(pieces)
    filler = n_vocab - len(tokens)
    if filler < 0:
        raise ValueError(f"a vocabulary needs at least {len(tokens)} tokens")
    tokens += [f"<filler_{index}>" for index in range(filler)]
    types += [int(TokenType.NORMAL)] * filler
    scores = [0.0 if kind != int(TokenType.NORMAL) else -float(index) for index, kind in enumerate(types)]
    return tokens, scores, types


class _Pools:
    """Windows of float16 normal pools, one pool per input width (scaled by 1/sqrt(width))."""

    def __init__(self, rng: np.random.Generator, widths: set[int]) -> None:
        base = rng.standard_normal(_POOL, dtype=np.float32)
        # Doubled so that any window up to the pool's length is a view, not a copy.
        self._pools = {
            width: np.tile((base / np.sqrt(width)).astype(np.float16), 2) for width in sorted(widths)
        }
        self._pools[0] = np.tile(base.astype(np.float16), 2)  # unscaled, for the embeddings
        self._rng = rng

    def matrix(self, rows: int, cols: int, scaled: bool = True) -> np.ndarray:
        # numpy shape (rows, cols) is ggml {cols, rows}: cols is the input dimension.
        pool = self._pools[cols if scaled else 0]
        count = rows * cols
        start = int(self._rng.integers(0, _POOL))
        if count <= _POOL:
            return pool[start : start + count].reshape(rows, cols)
        repeats = -(-(start + count) // _POOL)
        return np.tile(pool[:_POOL], repeats)[start : start + count].reshape(rows, cols)


def write_random_model(destination: Path, shape: Shape, name: str) -> None:
    rng = np.random.default_rng(_SEED)
    tokens, scores, types = _vocabulary(shape.n_vocab)
    head_dim = shape.n_embd // shape.n_head
    kv_dim = head_dim * shape.n_head_kv
    writer = GGUFWriter(str(destination), "llama")
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.MOSTLY_Q5_0 if shape.quantized else LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)

    pools = _Pools(rng, {shape.n_embd, shape.n_ff})

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape.n_embd)).astype(np.float32)

    def weight(name: str, matrix: np.ndarray, table: bool = False) -> None:
        if not shape.quantized:
            writer.add_tensor(name, matrix)
            return
        kind = GGMLQuantizationType.Q8_0 if table else GGMLQuantizationType.Q5_0
        data = quantize(matrix.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    weight("token_embd.weight", pools.matrix(shape.n_vocab, shape.n_embd, scaled=False), table=True)
    for layer in range(shape.n_layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", norm())
        weight(prefix + "attn_q.weight", pools.matrix(shape.n_embd, shape.n_embd))
        weight(prefix + "attn_k.weight", pools.matrix(kv_dim, shape.n_embd))
        weight(prefix + "attn_v.weight", pools.matrix(kv_dim, shape.n_embd))
        weight(prefix + "attn_output.weight", pools.matrix(shape.n_embd, shape.n_embd))
        writer.add_tensor(prefix + "ffn_norm.weight", norm())
        weight(prefix + "ffn_gate.weight", pools.matrix(shape.n_ff, shape.n_embd))
        weight(prefix + "ffn_up.weight", pools.matrix(shape.n_ff, shape.n_embd))
        weight(prefix + "ffn_down.weight", pools.matrix(shape.n_embd, shape.n_ff))
    writer.add_tensor("output_norm.weight", norm())
    weight("output.weight", pools.matrix(shape.n_vocab, shape.n_embd), table=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ensure_random_model(size: str = "large", directory: Path | None = None) -> Path:
    """The model's path, generating it on first use (atomically)."""
    shape = SIZES[size]
    path = (
        directory or cache_root() / "models"
    ) / f"meshnode-random-llama-{size}-v{RANDOM_MODEL_VERSION}.gguf"
    if not path.exists():
        with atomic_path(path) as temporary:
            write_random_model(temporary, shape, f"meshnode random llama ({size})")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--directory", type=Path, default=None, help="default: <cache>/models")
    args = parser.parse_args()
    print(ensure_random_model(args.size, args.directory))


if __name__ == "__main__":
    main()
