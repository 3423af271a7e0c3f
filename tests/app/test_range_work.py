"""The weight bytes that price part of a served range, read from the GGUF the shard serves."""

from __future__ import annotations

from pathlib import Path

from engines.gguf_file import read_gguf
from engines.gguf_info import model_info
from engines.slicing import ensure_slice, plan_model_slice
from engines.tiny_model import ensure_tiny_model
from meshnode.app.range_work import range_work_of_file
from meshnode.autoplace.stage_balance import step_costs


def test_a_whole_model_prices_a_range_by_the_bytes_a_step_reads() -> None:
    path = ensure_tiny_model()
    gguf = read_gguf(path)
    n_layers = model_info(gguf).n_layers
    costs = step_costs(n_layers, {t.name: t.nbytes for t in gguf.tensors})
    work = range_work_of_file(path, n_layers, 1, n_layers)
    assert work is not None
    assert work(1, n_layers) == sum(costs.per_layer[1:]) + costs.output
    # The last layer and the output projection: more than a layer's share of the range.
    tail_share = work(n_layers - 1, n_layers) / work(1, n_layers)
    assert tail_share == (costs.per_layer[-1] + costs.output) / (sum(costs.per_layer[1:]) + costs.output)
    assert tail_share > 1 / (n_layers - 1)


def test_a_file_that_does_not_hold_the_range_under_its_own_names_gives_no_pricing(tmp_path: Path) -> None:
    """A slice numbers its layers from 0: read as the model's, they would price the wrong layers,
    so the shard falls back to counting layers."""
    path = ensure_tiny_model()
    gguf = read_gguf(path)
    n_layers = model_info(gguf).n_layers
    plan = plan_model_slice(gguf, n_layers - 2, n_layers)
    assert plan is not None
    sliced = ensure_slice(gguf, "0" * 64, plan, tmp_path)
    assert range_work_of_file(sliced, n_layers, n_layers - 2, n_layers) is None
    assert range_work_of_file(tmp_path / "missing.gguf", n_layers, 0, n_layers) is None
