"""A GGUF with a header to plan from and nothing a llama.cpp engine can load: two blocks of an
architecture, one embedding tensor, none of the hyperparameters the loader needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def write_bare_gguf(path: Path, arch: str) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["write_bare_gguf"]
