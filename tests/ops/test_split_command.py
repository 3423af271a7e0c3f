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


def stage_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]


def test_speeds_give_each_node_layers_in_proportion_and_the_slow_one_no_output_projection(split, tiny_model):
    gguf = read_gguf(tiny_model)
    costs = step_costs(model_info(gguf).n_layers, {t.name: t.nbytes for t in gguf.tensors})
    result = split("--speeds", "1,0.33", "--model", str(tiny_model))
    assert result.returncode == 0, result.stderr
    # Rows in pipeline order: the node (as listed in --speeds), its range, its speed. The slow
    # node goes first, where no output projection falls to it, and gets 2 layers to the other's 4.
    rows = stage_rows(result.stdout)
    assert [(row[0], row[1], row[2]) for row in rows] == [("2", "0:2", "0.33"), ("1", "2:6", "1")]
    assert balanced_ranges(costs, 2, 2, speeds=[0.33, 1.0]) == [(0, 2), (2, 6)]
    # Equal speeds: the split of equal nodes.
    alike = split("--speeds", "1,1", "--model", str(tiny_model))
    plain = split("--nodes", "2", "--model", str(tiny_model))
    assert [row[1] for row in stage_rows(alike.stdout)] == [row[1] for row in stage_rows(plain.stdout)]


def test_memory_budgets_bound_each_node_and_wrong_lists_are_refused(split, tiny_model):
    gguf = read_gguf(tiny_model)
    sizes = {t.name: t.nbytes for t in gguf.tensors}
    layer = sum(size for name, size in sizes.items() if name.startswith("blk.2."))
    # The fast node has room for its tables and two layers only: the slow node takes the rest.
    room = sizes["token_embd.weight"] + sizes.get("output.weight", 0) + 2 * layer + 4 * 4096
    result = split("--speeds", "1,0.33", "--memory-budgets", f"{room},1G", "--model", str(tiny_model))
    assert result.returncode == 0, result.stderr
    ranges = {row[0]: row[1] for row in stage_rows(result.stdout)}
    start, end = (int(bound) for bound in ranges["1"].split(":"))
    assert end - start <= 3
    # No budget holds the tables the first and last stages need.
    result = split("--speeds", "1,1", "--memory-budgets", "1K,1K", "--model", str(tiny_model))
    assert result.returncode == 1
    assert "fits their memory" in result.stderr
    result = split("--nodes", "3", "--speeds", "1,1", "--model", str(tiny_model))
    assert result.returncode == 2
    assert "--speeds lists 2 node(s) for 3 nodes" in result.stderr
    assert split("--model", str(tiny_model)).returncode == 2
    with pytest.raises(SystemExit):
        split("--speeds", "1,-1", "--model", str(tiny_model))
