"""Acceptance (issue 55): real joins placed by time, and by memory where asked.

Real ``meshnode`` processes, real llama.cpp, the tiny model. C is created with the model and
serves all six layers; it announces the speed its validation forward measured. J1 joins with
only an invite and ``--speed-estimate 0.33`` (a third as fast as the mesh's fastest node): by
time it takes the one layer that makes the best route fastest (J1's layer at three times C's
per-layer time, then C's other five, against C's six alone), where its budget holds four. J2
joins with ``--place-by memory`` and takes four layers where replicas are fewest, as every
joiner did before speeds. The API answers through both with the whole model's greedy text.
A joiner told nothing of its speed probes it: a real shard of one middle layer, loaded,
calibrated and closed before it claims.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from helpers.joining_mesh import Mesh, completion, reference_text, tiny_budget, wait_placed

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


# No move while the test looks: J1's own calibration would make a wider range faster.
NO_MOVE = ("--move-settle", "600")


@pytest.fixture
def mesh(tmp_path) -> Iterator[Mesh]:
    model = ensure_tiny_model()
    placed = Mesh(tmp_path, model, (0, TINY_N_LAYERS), tiny_budget(model))
    try:
        placed.start()
        yield placed
    finally:
        placed.stop()


def test_a_joiner_stated_a_third_as_fast_takes_one_layer_and_a_memory_joiner_its_budget(mesh: Mesh):
    mesh.add_joiner("J1", *NO_MOVE, "--speed-estimate", "0.33")
    (first,) = wait_placed(*mesh.joiners).values()
    assert tuple(first["layers"]) == (0, 1), first
    assert first["place_by"] == "time" and first["placed_by"] == "time"
    assert first["own_speed"]["estimate"] == 0.33

    mesh.add_joiner("J2", *NO_MOVE, "--place-by", "memory")
    placed = wait_placed(*mesh.joiners)
    second = placed["J2"]
    # C on [0, 6) and J1 on [0, 1): four layers where replicas are fewest, the lowest start of the ties.
    assert tuple(second["layers"]) == (1, 5), second
    assert second["placed_by"] == "memory"
    assert asyncio.run(completion(mesh.creator.api_url())) == reference_text(mesh.model)


def test_a_joiner_that_knows_no_speed_of_its_own_probes_a_layer_and_places_by_time(mesh: Mesh):
    """No --speed-estimate: before it claims, the joiner loads its fetched middle layer in a
    shard of its own, reads the speed it calibrates, closes it, and places itself by time."""
    joiner = mesh.add_joiner("J1", *NO_MOVE)
    (placed,) = wait_placed(joiner, until=lambda placements: "moves_by" in placements["J1"]).values()
    # Its speed known, it watches for moves by time (its range was taken by time where that
    # gained 10 %, as it does unless the probe found it five times slower than the creator).
    assert placed["moves_by"] == "time", placed
    log = joiner.log_path.read_text()
    assert "this machine decodes layers [3, 4) in" in log, log[-3000:]
    assert placed["own_speed"]["source"] in {"probed", "measured"}
    assert asyncio.run(completion(mesh.creator.api_url())) == reference_text(mesh.model)
