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
projection dominating a token's work; tokens/s compare only within one run. ``llama3-8b``
(issue 53's model that needs the mesh): Llama 3 8B's shape (32 layers, n_embd 4096, n_ff 14336,
32 heads with 8 KV heads, a 128 256-token vocabulary) in Q4_0 throughout, about 4.6 GB — the
size of the Q4 files people run, so a range is gigabytes and a token's activations 16 KB.
(The package registries carry no whole model of this class: a Qwen 7B GGUF is published
there as two of its ~47 parts, which do not make a file.)

Generated in seconds: each float16 or gguf-py-quantized weight matrix is a window of a pre-scaled pool of float16
normal values (an odd length, so no two rows of a matrix are equal and no two tokens tie),
so making the model costs memory copies, not random draws. The numbers are meaningless;
the shapes, the dtype and the tokenizer (byte fallback, so any text tokenizes) are real,
and the bytes are deterministic. The Q4_0 shape's blocks are written directly instead
(gguf-py quantizes 8 billion floats in about 2.5 minutes here, after drawing
them, and its writer holds every tensor until the file is written: 4.5 GB): each 32-value
block is a float16 scale of random sign and a fixed size, 1 / (4.64 sqrt(input width)) so a
row's output has about unit variance like the float16 pools', and 16 bytes of uniformly
random nibbles; each tensor is written as it is made, so the generator holds one at a time.
"""

from __future__ import annotations

import argparse
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
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
    # Q4_0 blocks of random nibbles written directly (the shapes people run at 4 bits).
    q4_0: bool = False


SIZES = {
    "large": Shape(n_layers=12, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=4, n_vocab=32000),
    "small": Shape(n_layers=6, n_embd=512, n_ff=1408, n_head=8, n_head_kv=2, n_vocab=8000),
    "gemma270m": Shape(
        n_layers=18, n_embd=640, n_ff=2048, n_head=4, n_head_kv=1, n_vocab=262_144, quantized=True
    ),
    "llama3-8b": Shape(
        n_layers=32,
        n_embd=4096,
        n_ff=14336,
        n_head=32,
        n_head_kv=8,
        n_vocab=128_256,
        context=8192,
        q4_0=True,
    ),
    # The Q4_0 writer's test shape: the 8B one's head layout and weight type, tiny widths.
    "q4-tiny": Shape(n_layers=4, n_embd=256, n_ff=512, n_head=8, n_head_kv=2, n_vocab=4096, q4_0=True),
}
# Mean square of a uniform nibble less 8 (values -8..7): a Q4_0 weight's variance over its scale's square.
_NIBBLE_MEAN_SQUARE = 21.5


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


def _add_metadata(writer: GGUFWriter, shape: Shape, name: str) -> None:
    tokens, scores, types = _vocabulary(shape.n_vocab)
    head_dim = shape.n_embd // shape.n_head
    writer.add_name(name)
    if shape.q4_0:
        writer.add_file_type(LlamaFileType.MOSTLY_Q4_0)
    else:
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


def write_random_model(destination: Path, shape: Shape, name: str) -> None:
    if shape.q4_0:
        _write_q4_0_model(destination, shape, name)
        return
    rng = np.random.default_rng(_SEED)
    head_dim = shape.n_embd // shape.n_head
    kv_dim = head_dim * shape.n_head_kv
    writer = GGUFWriter(str(destination), "llama")
    _add_metadata(writer, shape, name)

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


def _layer_matrices(shape: Shape) -> list[tuple[str, int, int]]:
    """Every weight matrix in file order: (name, rows, input width); norms are added apart."""
    kv_dim = shape.n_embd // shape.n_head * shape.n_head_kv
    matrices = [("token_embd.weight", shape.n_vocab, shape.n_embd)]
    for layer in range(shape.n_layers):
        prefix = f"blk.{layer}."
        matrices += [
            (prefix + "attn_q.weight", shape.n_embd, shape.n_embd),
            (prefix + "attn_k.weight", kv_dim, shape.n_embd),
            (prefix + "attn_v.weight", kv_dim, shape.n_embd),
            (prefix + "attn_output.weight", shape.n_embd, shape.n_embd),
            (prefix + "ffn_gate.weight", shape.n_ff, shape.n_embd),
            (prefix + "ffn_up.weight", shape.n_ff, shape.n_embd),
            (prefix + "ffn_down.weight", shape.n_embd, shape.n_ff),
        ]
    matrices.append(("output.weight", shape.n_vocab, shape.n_embd))
    return matrices


def _q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, scaled: bool) -> np.ndarray:
    """``rows`` x ``cols`` Q4_0 values as raw blocks: (rows, cols / 32 * 18) bytes."""
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]
    count = rows * cols // block_values
    scale = 1.0 / np.sqrt(_NIBBLE_MEAN_SQUARE * (cols if scaled else 1))
    # A random sign per block: the nibbles' mean (-0.5 scale) then cancels instead of adding a
    # common offset to every output of the matrix.
    signs = rng.integers(0, 2, count, dtype=np.int8) * 2 - 1
    blocks = np.empty((count, block_bytes), dtype=np.uint8)
    blocks[:, :2] = (signs * scale).astype("<f2").view(np.uint8).reshape(count, 2)
    blocks[:, 2:] = rng.integers(0, 256, (count, block_bytes - 2), dtype=np.uint8)
    return blocks.reshape(rows, cols // block_values * block_bytes)


def _write_q4_0_model(destination: Path, shape: Shape, name: str) -> None:
    """Tensor infos first, then each tensor's bytes as it is made (one in memory at a time)."""
    rng = np.random.default_rng(_SEED)
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]
    writer = GGUFWriter(str(destination), "llama")
    _add_metadata(writer, shape, name)
    matrices = _layer_matrices(shape)
    norms = [f"blk.{layer}.{kind}_norm.weight" for layer in range(shape.n_layers) for kind in ("attn", "ffn")]
    norms.append("output_norm.weight")
    norm_bytes = shape.n_embd * 4
    for matrix, rows, cols in matrices:
        nbytes = rows * cols // block_values * block_bytes
        byte_shape = (rows, cols // block_values * block_bytes)
        writer.add_tensor_info(matrix, byte_shape, np.dtype(np.uint8), nbytes, GGMLQuantizationType.Q4_0)
    for norm in norms:
        writer.add_tensor_info(norm, (shape.n_embd,), np.dtype(np.float32), norm_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for matrix, rows, cols in matrices:
        writer.write_tensor_data(_q4_0_blocks(rng, rows, cols, scaled=matrix != "token_embd.weight"))
    for _ in norms:
        writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape.n_embd)).astype(np.float32))
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
