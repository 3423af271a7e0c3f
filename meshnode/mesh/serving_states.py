"""What an announcement's serving record and load say a peer does with its range (pure).

One reading for everyone who asks: the planner (may a route use it?), placement (is it a
claim or a served range?) and status (what does a user see?).
"""

from __future__ import annotations

from meshnode.wire.pb import mesh, shard

# Load states in which a node serving a range takes new sessions.
ACCEPTING_STATES = (shard.SERVING_STATE_UNSPECIFIED, shard.SERVING_STATE_SERVING)


def is_claim(announcement: mesh.PeerAnnouncement) -> bool:
    """A range the node is still fetching and loading: named without a runtime recipe, not
    serving (autoplace.mesh_models.claim_announcement). Routes skip it."""
    return (
        not announcement.serving.fingerprint.runtime_recipe_digest
        and announcement.load.serving_state == shard.SERVING_STATE_NOT_SERVING
    )


def serving_state_name(announcement: mesh.PeerAnnouncement) -> str:
    """``serving``, ``claimed``, ``draining`` or ``not serving``, for a user."""
    if is_claim(announcement):
        return "claimed"
    state = announcement.load.serving_state
    if state in ACCEPTING_STATES:
        return "serving"
    return shard.ServingState.Name(state).removeprefix("SERVING_STATE_").lower().replace("_", " ")


__all__ = ["ACCEPTING_STATES", "is_claim", "serving_state_name"]
