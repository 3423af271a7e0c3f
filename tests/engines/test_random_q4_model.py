"""bench/random_model.py's Q4_0 writer (the 8B shape's): its blocks load in llama.cpp, stay finite, repeat.

The 8B shape is written the same way as ``q4-tiny`` (the same code, only the widths differ),
so a tiny model shows what the 4.5 GB one would: every matrix is Q4_0 with the bytes its
shape needs, llama.cpp loads it and a prefill gives finite logits of about unit spread (the
scale keeps a row's output near unit variance, so 32 layers do not overflow), and a second
generation writes the same bytes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engines.gguf_file import read_gguf

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS, N_EMBD, N_FF, N_VOCAB = 4, 256, 512, 4096


def generate(directory: Path) -> Path:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "random_model.py"), "--size", "q4-tiny", "--directory", str(directory)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return Path(done.stdout.strip())


def test_q4_0_shape_has_every_matrix_in_q4_0_blocks_of_its_shape(tmp_path: Path) -> None:
    header = read_gguf(generate(tmp_path))
    tensors = {t.name: t for t in header.tensors}
    matrices = {name: t for name, t in tensors.items() if not name.endswith("norm.weight")}
    assert len(matrices) == 2 + 7 * N_LAYERS
    assert len(tensors) - len(matrices) == 2 * N_LAYERS + 1
    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]
    for name, tensor in matrices.items():
        assert GGMLQuantizationType(tensor.ggml_type) == GGMLQuantizationType.Q4_0, name
        values = int(np.prod(tensor.shape))
        assert tensor.nbytes == values // block_values * block_bytes, name
    assert tuple(tensors["token_embd.weight"].shape) == (N_EMBD, N_VOCAB)
    assert tuple(tensors["blk.0.ffn_down.weight"].shape) == (N_FF, N_EMBD)


def test_llama_cpp_prefills_it_to_finite_logits_of_about_unit_spread(tmp_path: Path) -> None:
    model = llama_cpp.Llama(str(generate(tmp_path)), n_ctx=128, logits_all=True, verbose=False)
    try:
        tokens = model.tokenize(b"the quick brown fox jumps over the lazy dog")
        model.eval(tokens)
        logits = np.array(model.scores[: model.n_tokens])
    finally:
        model.close()
    assert np.isfinite(logits).all()
    spread = logits.std(axis=1)
    assert ((spread > 0.25) & (spread < 4.0)).all(), spread


def test_a_second_generation_writes_the_same_bytes(tmp_path: Path) -> None:
    first = generate(tmp_path / "first").read_bytes()
    second = generate(tmp_path / "second").read_bytes()
    assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()
