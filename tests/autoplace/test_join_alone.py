"""Acceptance (issue 16): ``meshnode join --invite TOKEN`` alone places the node and fetches its layers.

Real ``meshnode`` processes over real QUIC and real llama.cpp. On the generated tiny model
(six layers, fast): C is created with the model and serves [0, 2); J1 and J2 start at the
same moment with only an invite, empty model stores and caches, and a budget that holds
four ordinary layers and one vocabulary-sized table, not a fifth layer. Both first want
the uncovered [2, 6); the lower node id keeps it, the other takes four layers where
replicas are fewest. Each fetched only the tensors of its range (bytes counted), and the
API answers with the whole model's greedy text. Killing the node on [2, 6) leaves layers
nobody serves: the survivor moves to cover them, fetching only what it lacked, and the
answers continue with the same text. On Gemma 3 270M, whose transfer is long enough to
interrupt: a joiner stopped mid-transfer exits, and started again resumes without fetching
again what it had verified or the part it had of the tensors it was fetching.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.joining_mesh import (
    PLACE_TIMEOUT_S,
    Mesh,
    completion,
    placement,
    reference_text,
    tiny_budget,
    wait_placed,
)

from engines.default_model import default_model_path
from engines.gguf_file import read_gguf
from engines.model_manifest import build_manifest
from engines.slicing import tensors_for_range
from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.artifacts.store import ArtifactStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Reply framing (protobuf fields, chunk headers) on top of the tensor bytes, generously.
FRAMING_SHARE = 0.01
FRAMING_BYTES = 64 * 1024
# Issue 16's rule, sized by memory: every node here announces its speed (the creator calibrates,
# a joiner probes), and by time the joiners would take other ranges (test_join_by_time.py).
BY_MEMORY = ("--place-by", "memory")


def needed_bytes(model: Path, layers: tuple[int, int], *, held: tuple[int, int] | None = None) -> int:
    """Bytes of the tensors ``layers`` needs (that a node holding ``held`` lacks)."""
    header = read_gguf(model)
    needed = tensors_for_range(header, *layers)
    if held is not None:
        needed -= tensors_for_range(header, *held)
    return sum(t.nbytes for t in header.tensors if t.name in needed)


def metadata_bytes(model: Path) -> int:
    return sum(len(record.raw) for record in read_gguf(model).metadata)


def covered(ranges: list[tuple[int, int]], total: int) -> bool:
    return {layer for start, end in ranges for layer in range(start, end)} == set(range(total))


@pytest.fixture(scope="module")
def tiny_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    model = ensure_tiny_model()
    placed = Mesh(
        tmp_path_factory.mktemp("join-alone"), model, (0, 2), tiny_budget(model), joiner_options=BY_MEMORY
    )
    try:
        placed.start("J1", "J2")
        yield placed
    finally:
        placed.stop()


@pytest.fixture(scope="module")
def reference(tiny_mesh: Mesh) -> str:
    return reference_text(tiny_mesh.model)


def test_joiners_with_only_an_invite_cover_the_model_fetching_only_their_ranges(tiny_mesh: Mesh, reference):
    mesh = tiny_mesh
    placed = wait_placed(*mesh.joiners)
    ranges = {name: tuple(p["layers"]) for name, p in placed.items()}
    # Two nodes joining at the same moment end on different ranges: the lower id keeps the gap.
    assert sorted(ranges.values()) == [(0, 4), (2, TINY_N_LAYERS)], placed
    assert covered([mesh.creator_layers, *ranges.values()], TINY_N_LAYERS)
    for name, layers in ranges.items():
        share = needed_bytes(mesh.model, layers)
        fetched = placed[name]["fetched_bytes"]
        assert share <= fetched <= share * (1 + FRAMING_SHARE) + FRAMING_BYTES, (name, layers, fetched)
        # The tail's table never went to the head range, nor the embedding to the tail.
        assert fetched < needed_bytes(mesh.model, (0, TINY_N_LAYERS))
    assert asyncio.run(completion(mesh.creator.api_url())) == reference


def test_killing_a_joiner_moves_the_other_to_cover_the_gap_and_answers_continue(tiny_mesh: Mesh, reference):
    mesh = tiny_mesh
    placed = wait_placed(*mesh.joiners)
    tail_name = next(name for name, p in placed.items() if p["layers"][1] == TINY_N_LAYERS)
    (tail,) = [j for j in mesh.joiners if j.name == tail_name]
    (survivor,) = [j for j in mesh.joiners if j is not tail]
    before = placed[survivor.name]
    tail.kill()
    after = wait_placed(
        survivor,
        until=lambda p: covered([mesh.creator_layers, tuple(p[survivor.name]["layers"])], TINY_N_LAYERS),
    )
    moved = after[survivor.name]
    assert tuple(moved["layers"]) == (2, TINY_N_LAYERS)
    # Only what it lacked came over the network the second time.
    lacking = needed_bytes(mesh.model, tuple(moved["layers"]), held=tuple(before["layers"]))
    assert (
        lacking
        <= moved["fetched_bytes"] - before["fetched_bytes"]
        <= lacking * (1 + FRAMING_SHARE) + FRAMING_BYTES
    )
    assert asyncio.run(completion(mesh.creator.api_url())) == reference


def test_a_joiner_stopped_mid_transfer_exits_and_resumes_without_refetching_what_it_had(tmp_path: Path):
    model = default_model_path(progress=False)
    # Gemma's middle layers within 60 MiB: no vocabulary table, about 44 MiB to fetch.
    mesh = Mesh(tmp_path, model, (0, 6), 60 * 2**20, joiner_options=BY_MEMORY)
    try:
        mesh.start()
        joiner = mesh.add_joiner("J3")
        deadline = time.monotonic() + PLACE_TIMEOUT_S
        while True:
            transfer = placement(joiner).get("transfer") or {}
            if transfer.get("total_bytes") and transfer["done_bytes"] >= transfer["total_bytes"] * 0.3:
                break
            assert not transfer.get("finished"), f"the transfer ended before it could be killed: {transfer}"
            assert time.monotonic() < deadline, joiner.log_path.read_text()[-3000:]
            time.sleep(0.05)
        layers = tuple(placement(joiner)["layers"])
        # SIGTERM, as a service manager stops it: it leaves and exits by itself (it once went on
        # retrying its placement after the node had stopped, until SIGKILLed).
        assert joiner.process is not None
        joiner.process.send_signal(signal.SIGTERM)
        assert joiner.process.wait(20) == 0, joiner.log_path.read_text()[-3000:]
        # Its fetch was stopped before its links closed: no failed source, nothing retried.
        stopped_log = joiner.log_path.read_text()
        assert "LinkClosed" not in stopped_log and "could not be fetched" not in stopped_log
        # What the stopped node had verified (its journal), and kept of the tensors it was fetching.
        manifest = build_manifest(model)
        store = ArtifactStore(joiner.data_dir / "models")
        with store.open(manifest, b"".join(r.raw for r in read_gguf(model).metadata)) as partial:
            verified = sum(t.nbytes for t in manifest.tensors if t.name in partial.verified)
            kept = sum(partial.unfinished_bytes(t.name) for t in manifest.tensors)
        needed = needed_bytes(model, layers)
        assert 0 < verified < needed

        mesh.start_joiner(joiner, "start")
        placed = wait_placed(joiner)[joiner.name]
        assert tuple(placed["layers"]) == layers, placed
        assert placed["transfer"]["resumed_bytes"] == verified + kept
        assert placed["fetched_bytes"] <= (needed - verified - kept) * (1 + FRAMING_SHARE) + FRAMING_BYTES
    finally:
        mesh.stop()
