"""What gossip says the mesh serves, as placement needs it: models, ranges served, claims. Pure.

A node announces a range with a routable fingerprint once it serves it; before it
loads, it announces the range it chose with the model's fingerprint only (no recipe
digest) and ``SERVING_STATE_NOT_SERVING``: a claim, which routes never use and other
joiners respect (:func:`meshnode.mesh.placement.choose_range`). A draining node is
leaving, so its range counts as neither.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass

from meshnode.mesh.placement import Claim, Range
from meshnode.mesh.serving_states import ACCEPTING_STATES, is_claim
from meshnode.wire.pb import mesh, shard

Announcements = Iterable[tuple[bytes, mesh.PeerAnnouncement]]

_HEX = frozenset(string.hexdigits)


@dataclass(frozen=True)
class MeshModel:
    # The manifest root (engines.model_manifest): what a joiner fetches and verifies against.
    fingerprint: str
    name: str
    total_layers: int


@dataclass(frozen=True)
class ModelCoverage:
    model: MeshModel
    # Ranges nodes serve now, by node.
    served: tuple[tuple[bytes, Range], ...]
    # Ranges nodes announced they are about to load.
    claims: tuple[Claim, ...]
    # Every node announcing the model (serving, claiming or draining): each may hold tensors of it.
    sources: tuple[bytes, ...]

    @property
    def served_ranges(self) -> list[Range]:
        return [layers for _, layers in self.served]


def is_manifest_root(digest: str) -> bool:
    """Whether ``digest`` can be a manifest root (a fake engine's digest, for one, is not)."""
    return len(digest) == 64 and set(digest) <= _HEX


def _served(announcement: mesh.PeerAnnouncement) -> tuple[MeshModel, Range] | None:
    if not announcement.HasField("serving"):
        return None
    served = announcement.serving
    digest = served.fingerprint.model_artifact_digest
    span = served.shard_range
    if not is_manifest_root(digest) or not 0 <= span.start_layer < span.end_layer <= served.total_layers:
        return None
    return MeshModel(digest, served.model_name, served.total_layers), (span.start_layer, span.end_layer)


def served_models(announcements: Announcements) -> list[MeshModel]:
    """Every model some node serves or claims, once each, in order of first mention."""
    found: dict[str, MeshModel] = {}
    for _, announcement in announcements:
        entry = _served(announcement)
        if entry is not None:
            found.setdefault(entry[0].fingerprint, entry[0])
    return list(found.values())


def coverage(announcements: Announcements, model: MeshModel, *, exclude: bytes) -> ModelCoverage:
    """Who serves, claims and may hold ``model``, leaving ``exclude`` (this node) out."""
    served: list[tuple[bytes, Range]] = []
    claims: list[Claim] = []
    sources: list[bytes] = []
    for node_id, announcement in announcements:
        entry = _served(announcement)
        if node_id == exclude or entry is None or entry[0].fingerprint != model.fingerprint:
            continue
        sources.append(node_id)
        if is_claim(announcement):
            claims.append(Claim(node_id, entry[1]))
        elif announcement.load.serving_state in ACCEPTING_STATES:
            served.append((node_id, entry[1]))
    return ModelCoverage(model, tuple(served), tuple(claims), tuple(sources))


def most_needed(announcements: Announcements, *, exclude: bytes) -> ModelCoverage | None:
    """The model with the most layers nobody serves or claims (then the one served by most nodes);
    None when the mesh serves no model this node could fetch."""
    listed = list(announcements)
    best: tuple[tuple[int, int], ModelCoverage] | None = None
    for model in served_models(listed):
        found = coverage(listed, model, exclude=exclude)
        held = [*found.served_ranges, *(claim.layers for claim in found.claims)]
        covered = {layer for start, end in held for layer in range(start, end)}
        rank = (model.total_layers - len(covered), len(found.sources))
        if best is None or rank > best[0]:
            best = (rank, found)
    return None if best is None else best[1]


def claim_announcement(
    model: MeshModel, layers: Range, speed: mesh.StageSpeed | None = None
) -> tuple[mesh.ServedShard, mesh.Load]:
    """What a node announces while it fetches and loads ``layers``: routes skip it, joiners see it
    (and, with ``speed``, the time it expects its range to take, to place themselves by)."""
    served = mesh.ServedShard(
        model_name=model.name,
        fingerprint=shard.Fingerprint(model_artifact_digest=model.fingerprint),
        shard_range=shard.ShardRange(
            start_layer=layers[0], end_layer=layers[1], effective_start_layer=layers[0]
        ),
        total_layers=model.total_layers,
    )
    if speed is not None:
        served.speed.CopyFrom(speed)
    return served, mesh.Load(serving_state=shard.SERVING_STATE_NOT_SERVING)


__all__ = [
    "Announcements",
    "MeshModel",
    "ModelCoverage",
    "claim_announcement",
    "coverage",
    "is_manifest_root",
    "most_needed",
    "served_models",
]
