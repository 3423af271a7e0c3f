"""meshnode.autoplace.speed_inputs: the peers' per-layer times from their records, this node's
own (measured, else stated against the fastest peer), and memory-only where one is unknown."""

from __future__ import annotations

import pytest

from meshnode.autoplace.mesh_models import MeshModel, claim_announcement, coverage
from meshnode.autoplace.speed_inputs import OwnSpeed, announced_per_layer, estimated_speed, timed_others
from meshnode.autoplace.time_balance import TimedRange
from meshnode.dataplane.stage_speed import StageSpeed, with_speed
from meshnode.mesh.validation import MAX_STAGE_US_PER_TOKEN
from meshnode.wire.pb import mesh, shard

MODEL = MeshModel("a" * 64, "tiny", 12)
OTHER = MeshModel("b" * 64, "other", 12)


def record(model: MeshModel, layers: tuple[int, int], decode_us: int | None, *, claim: bool = False):
    served, load = claim_announcement(model, layers)
    if not claim:
        served.fingerprint.runtime_recipe_digest = "r" * 64
        load = mesh.Load(serving_state=shard.SERVING_STATE_SERVING)
    speed = None if decode_us is None else StageSpeed(decode_us, 0, 0, measured=True)
    return mesh.PeerAnnouncement(serving=with_speed(served, speed), load=load)


def test_each_node_is_priced_per_layer_and_a_node_without_a_speed_makes_it_memory_only() -> None:
    announcements = [
        (b"\x01", record(MODEL, (0, 6), 6_000)),
        (b"\x02", record(MODEL, (6, 12), 18_000)),
        (b"\x03", record(OTHER, (0, 12), 1_200)),  # another model: not priced for this one
        (b"\x04", record(MODEL, (0, 4), None, claim=True)),  # a claim announces no speed
        (b"\x05", mesh.PeerAnnouncement()),
    ]
    per_layer = announced_per_layer(announcements, MODEL)
    assert per_layer == {b"\x01": 1_000, b"\x02": 3_000}
    found = coverage(announcements, MODEL, exclude=b"\x09")
    # The claim of \x04 is not one that keeps its range against this node: priced without it.
    assert timed_others(found, per_layer, claims_of=[]) == [
        TimedRange((0, 6), 1_000),
        TimedRange((6, 12), 3_000),
    ]
    assert timed_others(found, per_layer, claims_of=[b"\x04"]) is None
    assert timed_others(found, per_layer) is None


def test_own_speed_is_measured_once_serving_else_stated_against_the_fastest_peer() -> None:
    own = OwnSpeed(stated_factor=0.5)
    assert own.source == "stated"
    assert own.us_per_layer([2_000, 1_000, 9_000]) == 2_000  # the fastest 1 ms, at half its speed
    assert own.us_per_layer([]) is None  # nothing to price a factor against
    own.observe(None, (0, 4))  # not calibrated yet: still the estimate
    assert own.source == "stated"
    own.observe(StageSpeed(8_000, 0, 0, measured=False), (0, 4))
    assert own.source == "measured"
    assert own.us_per_layer([]) == 2_000
    # Kept once the shard stops, for the choice of the next range.
    own.observe(None, (0, 4))
    assert own.us_per_layer([1]) == 2_000
    assert OwnSpeed().us_per_layer([1_000]) is None
    assert OwnSpeed().source == "unknown"
    with pytest.raises(ValueError):
        OwnSpeed(stated_factor=0)


def test_a_claim_announces_its_estimate_which_prices_it_but_never_prices_a_stated_factor() -> None:
    estimate = estimated_speed(3_000, (0, 2))
    assert estimate.decode_us_per_token == 6_000
    assert estimate.source == mesh.STAGE_SPEED_SOURCE_ESTIMATED
    assert estimated_speed(1e12, (0, 12)).decode_us_per_token == MAX_STAGE_US_PER_TOKEN
    served, _ = claim_announcement(MODEL, (0, 2), estimate)
    claimed = mesh.PeerAnnouncement(
        serving=served, load=mesh.Load(serving_state=shard.SERVING_STATE_NOT_SERVING)
    )
    announcements = [(b"\x01", record(MODEL, (0, 12), 24_000)), (b"\x02", claimed)]
    assert announced_per_layer(announcements, MODEL) == {b"\x01": 2_000, b"\x02": 3_000}
    # A joiner's stated factor is priced against what nodes measured, not against estimates.
    assert announced_per_layer(announcements, MODEL, measured_only=True) == {b"\x01": 2_000}
