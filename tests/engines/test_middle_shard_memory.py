"""A middle shard holds its layers, its KV and its compute buffers, not the model's vocabulary
tables: measured in a fresh child process (so nothing else this test run loaded counts), its
resident memory beyond the process's own stays within 1.2x of what llama.cpp reports it
allocated, and its slice file holds no tensor with a vocabulary-sized dimension."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engines.gguf_file import read_gguf
from engines.gguf_info import read_model_info
from engines.resident_memory import (
    MIB,
    BufferReport,
    ProcessMemory,
    ShardBudget,
    ShardMemory,
    parse_proc_status,
    parse_smaps_file_rss,
    shard_memory,
    track_shard,
    untrack_shard,
)
from engines.tiny_model import TINY_N_LAYERS
from meshnode.app.status import format_status
from meshnode.metrics import _memory_families, samples_by_name

# Loads one shard as a node would (4 sessions of 2048 tokens), runs a 128-token prefill and
# 8 decodes through it (so the compute buffers are in use), then prints its memory report.
_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from engines.interface import LoadRequest, SessionKey, StepRequest
    from engines.llama_engine import LlamaShardEngine

    path, start, end, cache_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    engine = LlamaShardEngine()
    caps = engine.load(LoadRequest(path, start, end, n_ctx=int(sys.argv[5]), n_seq_max=4, n_batch=128,
                                   n_threads=2, cache_dir=cache_dir))
    rng = np.random.default_rng(3)
    key = SessionKey("memory", 1)
    hidden = rng.standard_normal((128, caps.hidden_size)).astype(np.float32)
    engine.prefill(StepRequest(key, 0, hidden=hidden))
    for step in range(8):
        one = rng.standard_normal((1, caps.hidden_size)).astype(np.float32)
        engine.decode(StepRequest(key, 128 + step, hidden=one, expected_past_len=128 + step))
    memory = engine.memory()
    report = memory.to_json()
    report["health_resident_bytes"] = engine.health().resident_bytes
    report["slice"] = str(engine._main.model_path)
    print(json.dumps(report))
    """
)

BUDGET_FACTOR = 1.2
# What a node serves by default (meshnode.app.shard_service.ShardServiceConfig.ctx).
NODE_CTX = 4096


def _measure(model: Path, start: int, end: int, cache_dir: Path, n_ctx: int = NODE_CTX) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), str(start), str(end), str(cache_dir), str(n_ctx)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _assert_middle_shard_fits(model: Path, start: int, end: int, cache_dir: Path) -> dict[str, Any]:
    report = _measure(model, start, end, cache_dir)
    budget = report["budget"]
    assert isinstance(budget, dict)
    shard, total = int(report["shard_bytes"]), int(report["budget_bytes"])
    print(
        f"\n{model.name} [{start}, {end}): resident {int(report['rss_bytes']) / MIB:.1f} MiB"
        f" ({int(report['rss_file_bytes']) / MIB:.1f} file-backed), shard {shard / MIB:.1f} MiB"
        f" against a budget of {total / MIB:.1f} MiB {budget}"
    )
    # Every part of the budget was reported: a missed log line would make the bound meaningless.
    assert budget["weights_bytes"] > 0 and budget["kv_bytes"] > 0 and budget["compute_bytes"] > 0
    # The engine's health reports the process's resident memory (not its weights' size).
    health, rss = int(report["health_resident_bytes"]), int(report["rss_bytes"])
    assert abs(health - rss) <= 0.05 * rss
    assert shard <= BUDGET_FACTOR * total

    vocabulary = read_model_info(model).vocab_size
    sliced = read_gguf(Path(str(report["slice"])))
    assert sliced.get("meshnode.slice.layer_start") == start
    oversized = [t.name for t in sliced.tensors if vocabulary in t.shape]
    assert oversized == [], f"vocabulary-sized tensors in a middle slice: {oversized}"
    return report


@pytest.mark.slow
def test_a_gemma_middle_shard_holds_no_vocabulary_table(gemma_model: Path, tmp_path: Path) -> None:
    report = _assert_middle_shard_fits(gemma_model, 6, 12, tmp_path)
    # The 170 MiB token_embd alone used to be resident in every shard; the slice is its layers.
    assert int(report["rss_file_bytes"]) < 100 * MIB


@pytest.mark.slow
def test_the_middle_of_a_three_way_tiny_split_fits_its_budget(tiny_model: Path, tmp_path: Path) -> None:
    # The middle of [0, 2), [2, 5), [5, 6).
    assert TINY_N_LAYERS == 6
    _assert_middle_shard_fits(tiny_model, 2, 5, tmp_path)


def test_the_budget_is_read_from_llama_cpp_buffer_lines() -> None:
    report = BufferReport()
    lines = [
        "load_tensors:   CPU_Mapped model buffer size =    24.77 MiB\n",
        "llama_context:        CPU  output buffer size =     0.50 MiB\n",
        "llama_kv_cache:        CPU KV buffer size =     2.00 MiB\n",
        "llama_kv_cache:        CPU KV buffer size =     5.00 MiB\n",
        "sched_reserve:        CPU compute buffer size =     4.69 MiB\n",
        # The context's destructor repeats the compute buffer; it must not count twice.
        "~llama_context:        CPU compute buffer size is   4.6924 MiB, matches expectation of   4.6924 MiB\n",
        "print_info: n_vocab          = 262144\n",
    ]
    counted = [report.note(line) for line in lines]
    assert counted == [True, True, True, True, True, False, False]
    budget = report.budget()
    assert budget.weights_bytes == round(24.77 * MIB) and budget.kv_bytes == 7 * MIB
    assert budget.compute_bytes == round(4.69 * MIB) and budget.output_bytes == MIB // 2
    assert budget.total_bytes == round(24.77 * MIB) + 7 * MIB + round(4.69 * MIB) + MIB // 2


def test_process_memory_is_read_from_proc_status() -> None:
    text = "Name:\tpython\nVmPeak:\t  999 kB\nVmRSS:\t   86668 kB\nRssAnon:\t   39100 kB\nRssFile:\t   47568 kB\n"
    memory = parse_proc_status(text)
    assert (memory.rss_bytes, memory.anon_bytes, memory.file_bytes) == (
        86668 * 1024,
        39100 * 1024,
        47568 * 1024,
    )


class _Shard:
    def __init__(self, budget: ShardBudget) -> None:
        self.budget = budget

    def memory_budget(self) -> ShardBudget:
        return self.budget


def test_the_process_reports_the_budget_of_the_shards_it_holds() -> None:
    """``shard_memory()`` adds up the shards tracked in this process; a closed one stops counting."""
    before = shard_memory()
    assert before is not None  # Linux: /proc is there
    shard = _Shard(ShardBudget(weights_bytes=3 * MIB, kv_bytes=2 * MIB, compute_bytes=MIB))
    track_shard(shard)
    try:
        held = shard_memory()
        assert held is not None
        assert held.budget.total_bytes == before.budget.total_bytes + 6 * MIB
        assert held.budget.kv_bytes == before.budget.kv_bytes + 2 * MIB
    finally:
        untrack_shard(shard)
    after = shard_memory()
    assert after is not None and after.budget == before.budget


def test_status_and_metrics_show_resident_memory_against_the_budget() -> None:
    memory = ShardMemory(
        process=ProcessMemory(rss_bytes=200 * MIB, file_bytes=50 * MIB, anon_bytes=150 * MIB),
        model_file_bytes=25 * MIB,
        budget=ShardBudget(weights_bytes=25 * MIB, kv_bytes=112 * MIB, compute_bytes=7 * MIB),
        baseline=ProcessMemory(rss_bytes=60 * MIB, file_bytes=20 * MIB, anon_bytes=40 * MIB),
    )
    # Anonymous growth (150 - 40) plus the mapped model file (25).
    assert memory.shard_bytes == 135 * MIB and memory.budget_ratio == pytest.approx(135 / 144)
    samples = samples_by_name(_memory_families(memory))
    assert ({"buffer": "kv"}, 112 * MIB) in samples["meshnode_shard_memory_budget_bytes"]
    assert samples["meshnode_shard_resident_bytes"] == [({}, 135 * MIB)]
    assert samples["meshnode_resident_file_bytes"] == [({}, 50 * MIB)]
    node = {
        "short_id": "abcd",
        "mesh_id": "m",
        "member": True,
        "addresses": ["10.0.0.1:7447"],
        "serving": None,
    }
    shown = format_status({"node": node, "peers": [], "sections": {"memory": memory.to_json()}})
    assert (
        "memory: 200 MiB resident (50 file-backed); the shard 135 MiB against its budget 144 MiB "
        "(weights 25, KV 112, compute 7, output 0, vocabulary 0, context tables 0)"
    ) in shown


def test_model_files_resident_pages_are_read_from_smaps() -> None:
    text = textwrap.dedent(
        """\
        7f0000000000-7f0001000000 r--s 00000000 08:01 1234                       /cache/slices/a-L6-12-pt-r2.gguf
        Size:              16384 kB
        Rss:               12000 kB
        7f0002000000-7f0002100000 r-xp 00000000 08:01 99                         /venv/llama_cpp/lib/libllama.so
        Size:               1024 kB
        Rss:                 900 kB
        7f0003000000-7f0003001000 rw-p 00000000 00:00 0
        Rss:                   4 kB
        7f0004000000-7f0004100000 r--s 00000000 08:01 1235                       /models/gemma.gguf
        Rss:                 512 kB
        """
    )
    assert parse_smaps_file_rss(text) == (12000 + 512) * 1024
