"""A tensor's bytes as a GGUF file holds them: what the store's and the writer's tests compare against."""

from __future__ import annotations

from pathlib import Path

from engines.gguf_file import read_gguf


def tensor_bytes(model: Path, name: str) -> bytes:
    gguf = read_gguf(model)
    info = next(t for t in gguf.tensors if t.name == name)
    with model.open("rb") as file:
        file.seek(gguf.data_offset + info.offset)
        return file.read(info.nbytes)
