"""A node's announced speed (ServedShard.speed) is its own signed word, bounded on receipt."""

import pytest

from meshnode.identity import NodeIdentity
from meshnode.mesh.signed_record import RECORD_DOMAIN, RecordFault, RecordRejected, open_record, sign_record
from meshnode.mesh.validation import MAX_STAGE_US_PER_TOKEN, validate_stage_speed
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NOW = 1_800_000_000.0
MESH = "mesh-1"
NODE = NodeIdentity.from_seed(b"\x11" * 32)
FORGER = NodeIdentity.from_seed(b"\x22" * 32)


def speed(decode=25_000, prefill=1_200, source=mesh.STAGE_SPEED_SOURCE_MEASURED) -> mesh.StageSpeed:
    return mesh.StageSpeed(
        decode_us_per_token=decode, prefill_us_per_token=prefill, samples=40, source=source
    )


def announcement(stage_speed: mesh.StageSpeed, identity: NodeIdentity = NODE) -> mesh.PeerAnnouncement:
    served = mesh.ServedShard(
        model_name="m", total_layers=18, shard_range={"start_layer": 0, "end_layer": 9}, speed=stage_speed
    )
    return mesh.PeerAnnouncement(
        endpoint_id=identity.node_id,
        mesh_id=MESH,
        addresses=["10.0.0.1:7447"],
        incarnation=int(NOW * 10**9) - 10**9,
        serving=served,
    )


def rejection(signed: mesh.SignedPeerRecord) -> RecordRejected:
    with pytest.raises(RecordRejected) as info:
        open_record(signed, mesh_id=MESH, unix_now=NOW)
    return info.value


def test_the_speed_rides_in_the_signed_record_and_verifies():
    opened = open_record(sign_record(NODE, announcement(speed())), mesh_id=MESH, unix_now=NOW)
    assert opened.node_id == NODE.node_id
    assert opened.announcement.serving.speed == speed()


def test_a_speed_claimed_for_a_node_but_signed_by_another_key_is_refused():
    # The forger writes a flattering (or damning) speed into the node's record and signs it itself.
    record = announcement(speed(decode=1)).SerializeToString()
    forged = mesh.SignedPeerRecord(record=record, signature=FORGER.sign(RECORD_DOMAIN + record))
    refused = rejection(forged)
    assert refused.fault is RecordFault.BAD_SIGNATURE and refused.node_id == NODE.node_id
    # Rewriting the speed in the node's genuine record breaks its signature just the same.
    genuine = sign_record(NODE, announcement(speed(decode=25_000)))
    altered = announcement(speed(decode=25_000))
    altered.serving.speed.decode_us_per_token = 1
    tampered = mesh.SignedPeerRecord(
        record=altered.SerializeToString(deterministic=True), signature=genuine.signature
    )
    assert rejection(tampered).fault is RecordFault.BAD_SIGNATURE


@pytest.mark.parametrize(
    ("bad", "detail"),
    [
        (
            speed(decode=0),
            f"serving.speed.decode_us_per_token 0 is not within 1..{MAX_STAGE_US_PER_TOKEN}",
        ),
        (
            speed(decode=MAX_STAGE_US_PER_TOKEN + 1),
            f"serving.speed.decode_us_per_token {MAX_STAGE_US_PER_TOKEN + 1} is not within "
            f"1..{MAX_STAGE_US_PER_TOKEN}",
        ),
        (
            speed(prefill=MAX_STAGE_US_PER_TOKEN + 1),
            f"serving.speed.prefill_us_per_token {MAX_STAGE_US_PER_TOKEN + 1} is above "
            f"{MAX_STAGE_US_PER_TOKEN}",
        ),
        (speed(source=mesh.STAGE_SPEED_SOURCE_UNSPECIFIED), "serving.speed.source 0 is not known"),
        (speed(source=7), "serving.speed.source 7 is not known"),
    ],
)
def test_a_speed_out_of_bounds_is_refused_with_its_reason(bad, detail):
    with pytest.raises(MeshRefusal) as info:
        validate_stage_speed(bad)
    assert info.value.code == mesh.MESH_ERROR_MALFORMED and info.value.detail == detail
    # Signed by the node itself, the record is still malformed: dropped, never believed.
    refused = rejection(sign_record(NODE, announcement(bad)))
    assert refused.fault is RecordFault.MALFORMED and refused.detail == detail


def test_the_bounds_themselves_are_accepted():
    validate_stage_speed(speed(decode=1, prefill=0))
    validate_stage_speed(
        speed(
            decode=MAX_STAGE_US_PER_TOKEN,
            prefill=MAX_STAGE_US_PER_TOKEN,
            source=mesh.STAGE_SPEED_SOURCE_CALIBRATED,
        )
    )


def test_a_claims_estimated_speed_verifies_and_an_unknown_source_is_still_refused():
    estimate = speed(prefill=0, source=mesh.STAGE_SPEED_SOURCE_ESTIMATED)
    opened = open_record(sign_record(NODE, announcement(estimate)), mesh_id=MESH, unix_now=NOW)
    assert opened.announcement.serving.speed.source == mesh.STAGE_SPEED_SOURCE_ESTIMATED
    validate_stage_speed(estimate)
    with pytest.raises(MeshRefusal) as refused:
        validate_stage_speed(speed(source=4))
    assert refused.value.code == mesh.MESH_ERROR_MALFORMED
