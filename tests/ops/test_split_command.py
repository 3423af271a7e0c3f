"""`meshnode split` prints the ranges whose stages cost alike, and refuses what cannot be split."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engines.gguf_file import read_gguf
from engines.gguf_info import model_info
from engines.tiny_model import ensure_tiny_model
from meshnode.app.cli import main
from meshnode.autoplace.stage_balance import balanced_ranges, step_costs


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def split(capsys):
    """``meshnode split ARGS`` through the command line's own entry point."""

    def run(*args: str) -> Run:
        code = main(["split", *args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="module")
def tiny_model():
    return ensure_tiny_model()


def test_each_node_gets_its_balanced_range(split, tiny_model):
    gguf = read_gguf(tiny_model)
    n_layers = model_info(gguf).n_layers
    expected = balanced_ranges(step_costs(n_layers, {t.name: t.nbytes for t in gguf.tensors}), 2, 2)
    result = split("--nodes", "2", "--model", str(tiny_model))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(int(row[0]), row[1]) for row in rows] == [
        (node, f"{start}:{end}") for node, (start, end) in enumerate(expected, start=1)
    ]
    assert f"{n_layers} layers over 2 nodes" in result.stdout
    assert "--layers A:B" in result.stdout


def test_no_nodes_more_nodes_than_layers_and_a_file_that_is_no_model_are_refused(split, tiny_model, tmp_path):
    n_layers = model_info(read_gguf(tiny_model)).n_layers
    result = split("--nodes", str(n_layers + 1), "--model", str(tiny_model))
    assert result.returncode == 2
    assert f"has {n_layers} layers, one at least per node" in result.stderr
    result = split("--nodes", "0", "--model", str(tiny_model))
    assert result.returncode == 2
    assert "a pipeline has one node at least" in result.stderr
    result = split("--nodes", "2", "--min-layers", "0", "--model", str(tiny_model))
    assert result.returncode == 2
    assert "a node serves one layer at least" in result.stderr
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    result = split("--nodes", "2", "--model", str(not_a_model))
    assert result.returncode == 1
    assert "cannot read" in result.stderr and result.stdout == ""


def test_the_built_in_gemma_gets_a_light_tail(split):
    """No --model: the built-in Gemma 3 270M, whose output projection outweighs its 18 layers."""

    def ranges(*args: str) -> list[tuple[str, str]]:
        result = split("--nodes", "3", *args)
        assert result.returncode == 0, result.stderr
        rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
        return [(row[1], row[4]) for row in rows]

    assert ranges() == [("0:8", "0:6"), ("8:16", "6:12"), ("16:18", "12:18")]
    assert ranges("--min-layers", "1") == [("0:8", "0:6"), ("8:17", "6:12"), ("17:18", "12:18")]
    assert "Slowest stage: 186.2 MB against 201.4 MB split evenly (8% less)." in split("--nodes", "3").stdout
