"""What placement by time (:mod:`.time_balance`) is fed: the peers' announced speeds and this
node's own, per layer. Pure.

A peer's per-layer decode time is the decode time it announces for its range
(``ServedShard.speed``, validated on receipt) over the layers it serves. This node's own:

* while it serves, the figure its shard announces (calibrated at load, then measured from its
  engine batches) over its layers, kept after it stops serving so that a node moving to
  another range chooses with what it measured;
* before it ever served, what a probe measured: a shard of one middle layer
  (:func:`probe_layers`) loaded and timed the way serving calibrates, then closed
  (meshnode.app.speed_probe);
* or, told so, a stated estimate (``--speed-estimate``): how fast this machine is
  against the mesh's fastest node, as a factor (0.33: a third as fast), priced against the
  shortest per-layer time the peers measured (not the estimates of other claims, which would
  compound; the fastest, not the median, so that a slow peer does not make a fast joiner's
  stated 1 slower). A node with neither places itself by memory, as before,
  and by time once its first range is calibrated (:class:`.time_balance.TimeReplacement`).

A claim announces this node's estimate for the range it claims (:func:`estimated_speed`,
``STAGE_SPEED_SOURCE_ESTIMATED``), so that nodes joining at the same moment price each other.
Any node on the route that announces no speed (one that predates speeds, or a claim of a node
that knows none of its own) makes the choice memory-only: a node of unknown speed
cannot be priced, and pricing it as average could move layers onto it that it cannot carry.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshnode.autoplace.mesh_models import Announcements, MeshModel, ModelCoverage
from meshnode.autoplace.slow_yield import Replica
from meshnode.autoplace.time_balance import TimedRange, us_per_layer
from meshnode.dataplane.stage_speed import StageSpeed
from meshnode.mesh.placement import Range
from meshnode.mesh.validation import MAX_STAGE_US_PER_TOKEN
from meshnode.wire.pb import mesh

PerLayer = dict[bytes, float]


def announced_per_layer(
    announcements: Announcements, model: MeshModel, *, measured_only: bool = False
) -> PerLayer:
    """Each node's per-layer decode time (us per token) for ``model``, of the nodes announcing one
    (``measured_only``: of those that measured it, leaving the estimates of claims out)."""
    found: PerLayer = {}
    for node_id, announcement in announcements:
        if not announcement.HasField("serving"):
            continue
        served = announcement.serving
        span = served.shard_range
        if (
            served.fingerprint.model_artifact_digest != model.fingerprint
            or not served.HasField("speed")
            or served.speed.decode_us_per_token == 0
            or (measured_only and served.speed.source == mesh.STAGE_SPEED_SOURCE_ESTIMATED)
            or not 0 <= span.start_layer < span.end_layer
        ):
            continue
        found[node_id] = us_per_layer(served.speed.decode_us_per_token, (span.start_layer, span.end_layer))
    return found


def timed_others(
    found: ModelCoverage, per_layer: PerLayer, *, claims_of: Iterable[bytes] | None = None
) -> list[TimedRange] | None:
    """The ranges served and the claims of ``claims_of`` (every claim when None), priced; None
    when one of them announces no speed."""
    keep = None if claims_of is None else set(claims_of)
    ranged = [
        *found.served,
        *((claim.node_id, claim.layers) for claim in found.claims if keep is None or claim.node_id in keep),
    ]
    if any(node_id not in per_layer for node_id, _ in ranged):
        return None
    return [TimedRange(layers, per_layer[node_id]) for node_id, layers in ranged]


def served_replicas(found: ModelCoverage, per_layer: PerLayer) -> list[Replica]:
    """The ranges served now (claims left out: not serving yet) by nodes announcing a speed, priced."""
    return [
        Replica(node_id, layers, per_layer[node_id])
        for node_id, layers in found.served
        if node_id in per_layer
    ]


def estimated_speed(own_us_per_layer: float, layers: Range) -> mesh.StageSpeed:
    """The speed a claim of ``layers`` announces: this node's per-layer time over them, an estimate
    (within what receivers accept)."""
    decode_us = round(own_us_per_layer * (layers[1] - layers[0]))
    return mesh.StageSpeed(
        decode_us_per_token=max(1, min(MAX_STAGE_US_PER_TOKEN, decode_us)),
        source=mesh.STAGE_SPEED_SOURCE_ESTIMATED,
    )


def probe_layers(n_layers: int) -> Range:
    """The slice a probe times: one middle layer, away from the embedding and output tables."""
    if n_layers < 1:
        raise ValueError("a model has at least one layer")
    middle = n_layers // 2 if n_layers > 2 else 0
    return middle, middle + 1


class OwnSpeed:
    """This node's per-layer decode time: measured while it serves, else probed, else stated
    against its peers."""

    def __init__(self, stated_factor: float | None = None) -> None:
        if stated_factor is not None and not stated_factor > 0:
            raise ValueError(f"a speed estimate is a positive factor, not {stated_factor}")
        self.stated_factor = stated_factor
        self._measured_us_per_layer: float | None = None
        self._probed_us_per_layer: float | None = None

    def probed(self, speed: StageSpeed | None, layers: Range) -> None:
        """What a probe of ``layers`` calibrated (None: it could not)."""
        if speed is not None and layers[1] > layers[0]:
            self._probed_us_per_layer = us_per_layer(speed.decode_us_per_token, layers)

    def observe(self, speed: StageSpeed | None, layers: Range) -> None:
        """What the shard serving ``layers`` announces now (None: nothing calibrated yet)."""
        if speed is not None and layers[1] > layers[0]:
            self._measured_us_per_layer = us_per_layer(speed.decode_us_per_token, layers)

    def us_per_layer(self, peers: Iterable[float]) -> float | None:
        """Per-layer decode time (us per token); None when neither measured nor stated (or stated
        with no peer speed to price it against)."""
        if self._measured_us_per_layer is not None:
            return self._measured_us_per_layer
        if self._probed_us_per_layer is not None:
            return self._probed_us_per_layer
        known = list(peers)
        if self.stated_factor is None or not known:
            return None
        return min(known) / self.stated_factor

    @property
    def source(self) -> str:
        """How the figure is known, for the placement status."""
        if self._measured_us_per_layer is not None:
            return "measured"
        if self._probed_us_per_layer is not None:
            return "probed"
        return "stated" if self.stated_factor is not None else "unknown"


__all__ = [
    "OwnSpeed",
    "PerLayer",
    "announced_per_layer",
    "estimated_speed",
    "probe_layers",
    "served_replicas",
    "timed_others",
]
