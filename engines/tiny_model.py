"""A tiny llama-architecture GGUF for tests, benches and demos: generated, never downloaded.

Random float32 weights from a fixed seed, six layers, and a small SentencePiece-style
vocabulary (control tokens, all 256 byte-fallback tokens, letters and a few words with
every prefix so the merges can reach them) plus a ChatML template, so llama.cpp's
tokenizer, detokenizer and chat template all work on it. Generated once per version
and cached; the bytes are deterministic.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType

from engines.atomic_files import atomic_path
from engines.cache import cache_root

TINY_MODEL_VERSION = 1
TINY_N_LAYERS = 6
TINY_N_EMBD = 64
TINY_N_HEAD = 4
TINY_N_HEAD_KV = 2
TINY_N_FF = 128
TINY_CONTEXT = 2048
_SEED = 20240601

_SPECIAL = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL), ("</s>", TokenType.CONTROL)]
_CHAT_SPECIAL = ["<|im_start|>", "<|im_end|>"]
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "this",
    "be",
    "at",
    "or",
    "one",
    "have",
    "not",
    "we",
    "hello",
    "world",
    "mesh",
    "node",
    "model",
    "layer",
    "shard",
    "token",
    "user",
    "assistant",
    "system",
    "machine",
    "pool",
    "run",
]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = [text for text, _ in _SPECIAL] + _CHAT_SPECIAL
    types = [int(kind) for _, kind in _SPECIAL] + [int(TokenType.CONTROL)] * len(_CHAT_SPECIAL)
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [int(TokenType.BYTE)] * 256
    pieces = ["▁", *string.ascii_letters, *string.digits, *".,!?'-:;()\n"]
    for word in _WORDS:
        marked = "▁" + word
        pieces += [marked[:end] for end in range(2, len(marked) + 1)]
        pieces += [word[:end] for end in range(2, len(word) + 1)]
    for piece in dict.fromkeys(pieces):  # de-duplicated, first occurrence order
        if piece not in tokens:
            tokens.append(piece)
            types.append(int(TokenType.NORMAL))
    # SentencePiece merges the highest-scoring pair first: prefer longer pieces.
    scores = [0.0] * len(tokens)
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == int(TokenType.NORMAL):
            scores[index] = float(len(token)) - index * 1e-3
    return tokens, scores, types


def _weights(rng: np.random.Generator, n_vocab: int) -> dict[str, np.ndarray]:
    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is ggml {cols, rows}: cols is the input dimension.
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(TINY_N_EMBD)).astype(np.float32)

    head_dim = TINY_N_EMBD // TINY_N_HEAD
    kv_dim = head_dim * TINY_N_HEAD_KV
    tensors = {"token_embd.weight": rng.standard_normal((n_vocab, TINY_N_EMBD)).astype(np.float32)}
    for layer in range(TINY_N_LAYERS):
        prefix = f"blk.{layer}."
        tensors |= {
            prefix + "attn_norm.weight": norm(),
            prefix + "attn_q.weight": matrix(TINY_N_EMBD, TINY_N_EMBD),
            prefix + "attn_k.weight": matrix(kv_dim, TINY_N_EMBD),
            prefix + "attn_v.weight": matrix(kv_dim, TINY_N_EMBD),
            prefix + "attn_output.weight": matrix(TINY_N_EMBD, TINY_N_EMBD),
            prefix + "ffn_norm.weight": norm(),
            prefix + "ffn_gate.weight": matrix(TINY_N_FF, TINY_N_EMBD),
            prefix + "ffn_up.weight": matrix(TINY_N_FF, TINY_N_EMBD),
            prefix + "ffn_down.weight": matrix(TINY_N_EMBD, TINY_N_FF),
        }
    tensors["output_norm.weight"] = norm()
    tensors["output.weight"] = matrix(n_vocab, TINY_N_EMBD)
    return tensors


def tiny_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """The tiny vocabulary: tokens, SentencePiece scores and token types."""
    return _vocabulary()


def add_tiny_tokenizer(writer: GGUFWriter, tokens: list[str], scores: list[float], types: list[int]) -> None:
    """Write the tiny vocabulary, its special tokens and the ChatML template (any architecture
    loads it: llama.cpp picks the tokenizer from ``tokenizer.ggml.model``, not the architecture)."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_model(destination: Path) -> None:
    tokens, scores, types = _vocabulary()
    writer = GGUFWriter(str(destination), "llama")
    writer.add_name("meshnode tiny llama")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(TINY_CONTEXT)
    writer.add_embedding_length(TINY_N_EMBD)
    writer.add_block_count(TINY_N_LAYERS)
    writer.add_feed_forward_length(TINY_N_FF)
    writer.add_head_count(TINY_N_HEAD)
    writer.add_head_count_kv(TINY_N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(TINY_N_EMBD // TINY_N_HEAD)
    writer.add_rope_freq_base(10000.0)
    add_tiny_tokenizer(writer, tokens, scores, types)
    for name, tensor in _weights(np.random.default_rng(_SEED), len(tokens)).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ensure_tiny_model(directory: Path | None = None) -> Path:
    """The tiny model's path, generating it on first use (atomically, so racing processes are safe)."""
    path = (directory or cache_root() / "models") / f"meshnode-tiny-llama-v{TINY_MODEL_VERSION}.gguf"
    if not path.exists():
        with atomic_path(path) as temporary:
            write_tiny_model(temporary)
    return path
