"""What a GGUF model is, read from its header without loading weights (for planners and the head)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.gguf_file import GGUFFile, GGUFFormatError, metadata_int, read_gguf


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    name: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int


def _int_key(gguf: GGUFFile, key: str) -> int:
    value = gguf.get(key)
    if value is None:
        raise GGUFFormatError(f"{gguf.path}: {key} is missing")
    return metadata_int(value)


def model_info(gguf: GGUFFile) -> ModelInfo:
    arch = gguf.architecture
    vocab = gguf.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = gguf.entry("tokenizer.ggml.tokens")
        vocab = tokens.array_length if tokens is not None else 0
    name = gguf.get("general.name")
    return ModelInfo(
        architecture=arch,
        name=name if isinstance(name, str) and name else gguf.path.stem,
        n_layers=_int_key(gguf, f"{arch}.block_count"),
        hidden_size=_int_key(gguf, f"{arch}.embedding_length"),
        vocab_size=metadata_int(vocab),
        context_length=_int_key(gguf, f"{arch}.context_length"),
    )


def read_model_info(path: Path | str) -> ModelInfo:
    return model_info(read_gguf(path))
