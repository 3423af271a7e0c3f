"""A node with repacked weights held them twice: llama.cpp's repacked copy, and every page of the
model file it had read them through, still mapped and resident (Llama 3 8B's shape, a third of
it per node: 1.6 GiB mapped plus 1.6 GiB repacked, and a budget that counted both). Once the
weights are repacked, the mapping's pages are given back (engines.mapped_pages): the shard's
mapped file is then resident only where llama.cpp still reads it, its budget counts the
repacked weights once, and it computes what it computed before.

On the q4-tiny shape (bench/random_model.py: Llama 3 8B's weight type, tiny widths), in a fresh
child process per setting so that nothing this test run mapped counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines.mapped_pages import file_mappings
from engines.resident_memory import MIB, BufferReport

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import json, sys
    from engines.interface import LoadRequest, SessionKey
    from engines.llama_engine import LlamaShardEngine
    from engines.engine_chain import chain_step
    from engines.resident_memory import model_file_memory, shard_memory

    model_path, repack = sys.argv[1], sys.argv[2] == "on"
    engine = LlamaShardEngine()
    engine.load(LoadRequest(model_path, 0, 4, n_ctx=128, n_seq_max=1, n_batch=32, n_threads=1,
                            weight_repack=repack))
    loaded_file_bytes = model_file_memory()
    tokens = []
    token = chain_step([engine], SessionKey("s", 1), 0, tuple(range(300, 316)), want_logits=False).token_id
    for position in range(16, 24):
        tokens.append(token)
        token = chain_step([engine], SessionKey("s", 1), position, (token,), want_logits=False).token_id
    memory = shard_memory()
    print(json.dumps({
        "buffers": engine.weight_buffers,
        "loaded_file_bytes": loaded_file_bytes,
        "budget_weights": memory.budget.weights_bytes,
        "tokens": tokens,
    }))
    """
)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "random_model.py"), "--size", "q4-tiny",
         "--directory", str(tmp_path_factory.mktemp("q4"))],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return Path(done.stdout.strip())


def load_in_child(model: Path, repack: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), repack],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_repacked_shard_holds_its_weights_once_and_computes_the_same(q4_model: Path) -> None:
    repacked = load_in_child(q4_model, "on")
    plain = load_in_child(q4_model, "off")
    buffers = repacked["buffers"]
    repacked_mib = sum(mib for name, mib in buffers.items() if name in ("CPU_REPACK", "AMX"))
    if not repacked_mib:
        pytest.skip(f"llama.cpp repacks no Q4_0 weights on this CPU: {buffers}")
    mapped_mib = buffers["CPU_Mapped"]
    # Before: the whole mapped span stayed resident after the load (pre-faulted by llama.cpp).
    assert repacked["loaded_file_bytes"] < (mapped_mib - repacked_mib / 2) * MIB, repacked
    assert plain["loaded_file_bytes"] >= 0.9 * plain["buffers"]["CPU_Mapped"] * MIB, plain
    # The budget counts the repacked weights once: the mapped span, not the span and the copy.
    assert repacked["budget_weights"] == pytest.approx(mapped_mib * MIB, abs=MIB), repacked
    assert repacked["tokens"] == plain["tokens"]


def test_file_mappings_finds_every_mapping_of_the_file_by_its_real_path(tmp_path: Path) -> None:
    model = tmp_path / "a model.gguf"
    model.write_bytes(b"")
    (tmp_path / "link.gguf").symlink_to(model)
    maps = "\n".join([
        f"7f0000000000-7f0000400000 r--s 00000000 08:01 12 {model}",
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0 ",
        f"7f1000000000-7f1000001000 r--s 00400000 08:01 12 {model}",
        f"7f2000000000-7f2000001000 r--s 00000000 08:01 13 {tmp_path / 'other.gguf'}",
    ])  # fmt: skip
    assert file_mappings(tmp_path / "link.gguf", maps) == [
        (0x7F0000000000, 0x7F0000400000),
        (0x7F1000000000, 0x7F1000001000),
    ]


def test_the_budget_subtracts_the_repacked_span_only_once_its_pages_are_released() -> None:
    lines = [
        "load_tensors:   CPU_Mapped model buffer size =  1638.00 MiB",
        "load_tensors:   CPU_REPACK model buffer size =  1600.00 MiB",
    ]
    report = BufferReport()
    for line in lines:
        assert report.note(line)
    assert report.budget().weights_bytes == 3238 * MIB
    report.note_mapped_pages_released()
    assert report.budget().weights_bytes == 1638 * MIB
