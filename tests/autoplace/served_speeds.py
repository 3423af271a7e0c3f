"""What the placement tests' nodes announce: a tiny-model range served, at a stated speed or none."""

from __future__ import annotations

from engines.tiny_model import TINY_N_LAYERS
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.node import Node
from meshnode.wire.pb import mesh, shard

RECIPE = "r" * 64


def speed_for(layers: tuple[int, int], us_per_layer: int, *, measured: bool = False) -> StageSpeed:
    """``us_per_layer`` for each layer of ``layers``: stated (no samples) or as a measured one reads."""
    return StageSpeed(
        decode_us_per_token=us_per_layer * (layers[1] - layers[0]),
        prefill_us_per_token=0,
        samples=10 if measured else 0,
        measured=measured,
    )


def announce(node: Node, root: str, layers: tuple[int, int], speed: StageSpeed | None = None) -> None:
    """``node`` serves ``layers`` of the tiny model ``root`` (at ``speed``; None: it says none), as
    gossip will show it."""
    served = mesh.ServedShard(
        model_name="tiny",
        fingerprint=shard.Fingerprint(model_artifact_digest=root, runtime_recipe_digest=RECIPE),
        shard_range=shard.ShardRange(start_layer=layers[0], end_layer=layers[1]),
        total_layers=TINY_N_LAYERS,
    )
    if speed is not None:
        served.speed.CopyFrom(speed.message())
    node.set_serving(served)
    node.set_load(mesh.Load(serving_state=shard.SERVING_STATE_SERVING))
