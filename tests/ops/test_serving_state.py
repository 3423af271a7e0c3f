"""A peer's claim (layers it is still fetching and loading) shows as claimed in status, not as
served: a user, or a test, who read "serving [0:6)" from a claim asked for a route that no
node could take yet (the API answered 503, "no route covers layers [3, 6)")."""

from __future__ import annotations

from meshnode.app.status import _serving_text
from meshnode.autoplace.mesh_models import MeshModel, claim_announcement
from meshnode.node.status_report import ServingStatus
from meshnode.wire.pb import mesh, shard

MODEL = MeshModel("m" * 64, "tiny", 6)


def announcement(serving: mesh.ServedShard, load: mesh.Load) -> mesh.PeerAnnouncement:
    return mesh.PeerAnnouncement(serving=serving, load=load)


def test_a_claim_is_claimed_and_a_loaded_shard_is_serving_or_as_its_load_says() -> None:
    served, load = claim_announcement(MODEL, (0, 6))
    claimed = ServingStatus.of(announcement(served, load))
    assert (
        claimed is not None
        and claimed.state == "claimed"
        and (claimed.start_layer, claimed.end_layer) == (0, 6)
    )

    served.fingerprint.runtime_recipe_digest = "r" * 64  # loaded: the recipe is known
    for serving_state, shown in (
        (shard.SERVING_STATE_SERVING, "serving"),
        (shard.SERVING_STATE_UNSPECIFIED, "serving"),
        (shard.SERVING_STATE_DRAINING, "draining"),
        (shard.SERVING_STATE_NOT_SERVING, "not serving"),
    ):
        status = ServingStatus.of(announcement(served, mesh.Load(serving_state=serving_state)))
        assert status is not None and status.state == shown


def test_the_status_text_says_when_a_range_is_not_served_yet() -> None:
    served, load = claim_announcement(MODEL, (0, 6))
    claimed = ServingStatus.of(announcement(served, load))
    assert claimed is not None
    text = _serving_text(claimed.__dict__)
    assert text.startswith("tiny [0:6) of 6") and text.endswith(", claimed")
    served.fingerprint.runtime_recipe_digest = "r" * 64
    serving = ServingStatus.of(announcement(served, mesh.Load(serving_state=shard.SERVING_STATE_SERVING)))
    assert serving is not None and not _serving_text(serving.__dict__).endswith(", serving")


def test_the_status_shows_a_nodes_announced_speed_and_nothing_when_unsaid() -> None:
    served, _ = claim_announcement(MODEL, (0, 6))
    served.fingerprint.runtime_recipe_digest = "r" * 64
    serving_load = mesh.Load(serving_state=shard.SERVING_STATE_SERVING)
    unsaid = ServingStatus.of(announcement(served, serving_load))
    assert unsaid is not None and unsaid.decode_ms_per_token is None and unsaid.speed_source == ""
    assert _serving_text(unsaid.__dict__) == "tiny [0:6) of 6 (numerics unreported)"

    served.speed.CopyFrom(
        mesh.StageSpeed(decode_us_per_token=40_000, source=mesh.STAGE_SPEED_SOURCE_CALIBRATED)
    )
    calibrated = ServingStatus.of(announcement(served, serving_load))
    assert calibrated is not None
    assert (calibrated.decode_ms_per_token, calibrated.prefill_ms_per_token) == (40.0, None)
    assert _serving_text(calibrated.__dict__).endswith(", decode 40.0 ms/token (calibrated)")

    served.speed.CopyFrom(
        mesh.StageSpeed(
            decode_us_per_token=25_000,
            prefill_us_per_token=1_250,
            samples=40,
            source=mesh.STAGE_SPEED_SOURCE_MEASURED,
        )
    )
    measured = ServingStatus.of(announcement(served, serving_load))
    assert measured is not None and measured.speed_source == "measured"
    assert _serving_text(measured.__dict__) == (
        "tiny [0:6) of 6 (numerics unreported), decode 25.0 ms/token, prefill 1.2 ms/token (measured, 40 batches)"
    )
