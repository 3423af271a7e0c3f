"""What a route says about how it computes: numerics runs, the log text and system_fingerprint."""

from __future__ import annotations

from meshnode.head.numerics import (
    NumericsRun,
    describe_numerics,
    mixes_numerics,
    numerics_runs,
    system_fingerprint,
)
from meshnode.head.planner import Hop, ModelIdentity, Route
from meshnode.wire.pb import shard

MODEL = ModelIdentity("sha256:aa", "sha256:r1", 18)
GPU = "llama-cpp-python 0.3.36; gpu; weight repack off"
CPU = "llama-cpp-python 0.3.36; cpu; weight repack on"


def route(*hops: tuple[int, int, str], model: ModelIdentity = MODEL) -> Route:
    """Hops as (start, end, numerics), tiling the model in order."""
    return Route(
        model=model,
        model_name="gemma",
        hops=tuple(
            Hop(bytes([i]) * 32, start, end, start, numerics) for i, (start, end, numerics) in enumerate(hops)
        ),
    )


def test_runs_merge_adjacent_hops_that_compute_alike():
    mixed = route((0, 6, GPU), (6, 12, GPU), (12, 18, CPU))
    assert numerics_runs(mixed.hops) == (NumericsRun(0, 12, GPU), NumericsRun(12, 18, CPU))
    assert mixes_numerics(mixed)
    assert describe_numerics(mixed) == f"[0,12) {GPU} | [12,18) {CPU}"
    uniform = route((0, 9, CPU), (9, 18, CPU))
    assert not mixes_numerics(uniform)
    assert describe_numerics(route((0, 18, ""))) == "[0,18) unreported"


def test_runs_start_where_an_overlapping_hop_starts_executing():
    overlapping = Route(MODEL, "gemma", (Hop(b"a" * 32, 0, 10, 0, GPU), Hop(b"b" * 32, 6, 18, 10, CPU)))
    assert numerics_runs(overlapping.hops) == (NumericsRun(0, 10, GPU), NumericsRun(10, 18, CPU))


def test_the_fingerprint_follows_the_numerics_not_the_cuts_over_a_float32_boundary():
    whole = system_fingerprint(route((0, 18, CPU)))
    assert whole.startswith("fp_") and len(whole) == 15
    assert system_fingerprint(route((0, 6, CPU), (6, 18, CPU))) == whole
    mixed = system_fingerprint(route((0, 9, GPU), (9, 18, CPU)))
    assert mixed != whole
    # Which layers ran where matters, not only which numerics took part.
    assert system_fingerprint(route((0, 9, CPU), (9, 18, GPU))) != mixed
    assert system_fingerprint(route((0, 12, GPU), (12, 18, CPU))) != mixed
    other_contract = ModelIdentity("sha256:aa", "sha256:r2", 18)
    assert system_fingerprint(route((0, 18, CPU), model=other_contract)) != whole


def test_a_narrower_boundary_makes_the_cuts_part_of_the_fingerprint():
    bf16 = shard.DTYPE_BFLOAT16
    one_cut = system_fingerprint(route((0, 6, CPU), (6, 18, CPU)), bf16)
    assert one_cut != system_fingerprint(route((0, 9, CPU), (9, 18, CPU)), bf16)
    assert one_cut != system_fingerprint(route((0, 6, CPU), (6, 18, CPU)))
