"""`meshnode split` prints the ranges whose stages cost alike, and refuses what cannot be split."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engines.gguf_file import read_gguf
from engines.gguf_info import model_info
from engines.tiny_model import ensure_tiny_model
from meshnode.autoplace.stage_balance import balanced_ranges, step_costs


def split(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", "split", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def tiny_model():
    return ensure_tiny_model()


def test_each_node_gets_its_balanced_range(tiny_model):
    gguf = read_gguf(tiny_model)
    n_layers = model_info(gguf).n_layers
    expected = balanced_ranges(step_costs(n_layers, {t.name: t.nbytes for t in gguf.tensors}), 2)
    result = split("--nodes", "2", "--model", str(tiny_model))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(int(row[0]), row[1]) for row in rows] == [
        (node, f"{start}:{end}") for node, (start, end) in enumerate(expected, start=1)
    ]
    assert f"{n_layers} layers over 2 nodes" in result.stdout
    assert "--layers A:B" in result.stdout


def test_no_nodes_more_nodes_than_layers_and_a_file_that_is_no_model_are_refused(tiny_model, tmp_path):
    n_layers = model_info(read_gguf(tiny_model)).n_layers
    result = split("--nodes", str(n_layers + 1), "--model", str(tiny_model))
    assert result.returncode == 2
    assert f"has {n_layers} layers, one at least per node" in result.stderr
    result = split("--nodes", "0", "--model", str(tiny_model))
    assert result.returncode == 2
    assert "a pipeline has one node at least" in result.stderr
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    result = split("--nodes", "2", "--model", str(not_a_model))
    assert result.returncode == 1
    assert "cannot read" in result.stderr and result.stdout == ""
