"""What placement reads from gossip: models served, ranges served, claims, sources."""

from __future__ import annotations

from meshnode.autoplace.mesh_models import (
    MeshModel,
    claim_announcement,
    coverage,
    is_manifest_root,
    most_needed,
    served_models,
)
from meshnode.mesh.placement import Claim
from meshnode.wire.pb import mesh, shard

ROOT_A = "a" * 64
ROOT_B = "b" * 64
MODEL_A = MeshModel(ROOT_A, "gemma", 18)


def node(n: int) -> bytes:
    return bytes([n]) * 32


def serving(root: str, start: int, end: int, *, total: int = 18, state: int = shard.SERVING_STATE_SERVING):
    return mesh.PeerAnnouncement(
        serving=mesh.ServedShard(
            model_name="gemma",
            fingerprint=shard.Fingerprint(model_artifact_digest=root, runtime_recipe_digest="r" * 64),
            shard_range=shard.ShardRange(start_layer=start, end_layer=end),
            total_layers=total,
        ),
        load=mesh.Load(serving_state=state),
    )


def claiming(model: MeshModel, start: int, end: int) -> mesh.PeerAnnouncement:
    served, load = claim_announcement(model, (start, end))
    return mesh.PeerAnnouncement(serving=served, load=load)


def test_a_manifest_root_is_64_hex_characters():
    assert is_manifest_root(ROOT_A)
    assert not is_manifest_root("fake-engine-digest")
    assert not is_manifest_root("g" * 64)


def test_served_ranges_claims_and_sources_are_told_apart():
    announcements = [
        (node(1), serving(ROOT_A, 0, 6)),
        (node(2), claiming(MODEL_A, 6, 12)),
        (node(3), serving(ROOT_A, 12, 18, state=shard.SERVING_STATE_DRAINING)),
        (node(4), serving(ROOT_B, 0, 18)),
        (node(5), serving(ROOT_A, 0, 18)),  # this node: left out
    ]
    found = coverage(announcements, MODEL_A, exclude=node(5))
    assert found.served == ((node(1), (0, 6)),)
    assert found.claims == (Claim(node(2), (6, 12)),)
    # A draining node serves no new sessions but still holds its tensors.
    assert found.sources == (node(1), node(2), node(3))


def test_a_node_serving_no_manifest_rooted_model_offers_nothing_to_place_on():
    announcements = [(node(1), serving("fake", 0, 18)), (node(2), mesh.PeerAnnouncement())]
    assert served_models(announcements) == []
    assert most_needed(announcements, exclude=node(9)) is None


def test_the_model_with_most_uncovered_layers_is_the_one_to_join():
    announcements = [
        (node(1), serving(ROOT_A, 0, 18)),
        (node(2), serving(ROOT_B, 0, 6)),
    ]
    found = most_needed(announcements, exclude=node(9))
    assert found is not None and found.model.fingerprint == ROOT_B


def test_a_claim_is_announced_with_no_recipe_and_not_serving():
    served, load = claim_announcement(MODEL_A, (6, 12))
    assert served.fingerprint.model_artifact_digest == ROOT_A
    assert not served.fingerprint.runtime_recipe_digest
    assert (served.shard_range.start_layer, served.shard_range.end_layer, served.total_layers) == (6, 12, 18)
    assert load.serving_state == shard.SERVING_STATE_NOT_SERVING


def test_a_claim_is_not_a_route_candidate():
    from meshnode.head.candidates import shard_candidate

    assert shard_candidate(node(2), claiming(MODEL_A, 6, 12)) is None
