"""How a node places itself (:class:`AutoPlaceConfig`), apart from the placement loop so that
the command line reads it without loading it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# What a joiner's range is sized by: how long its layers take against the other nodes' (where
# it and every node on the route announce a speed; memory-only otherwise), or memory alone.
PLACE_BY_TIME, PLACE_BY_MEMORY = "time", "memory"


@dataclass(frozen=True)
class AutoPlaceConfig:
    store_dir: Path
    # Bytes of weights at most (--memory-budget); None: half the memory available.
    memory_budget: int | None = None
    # The weights go to the GPUs (--n-gpu-layers): the memory available is theirs, not RAM.
    offload: bool = False
    # How often gossip is looked at (the heartbeat interval).
    poll_s: float = 5.0
    # How long a claim stands before the node loads it: a few gossip rounds.
    claim_settle_s: float = 15.0
    # How long a better range must stay better before a serving node moves to it.
    move_settle_s: float = 60.0
    min_gain_layers: int = 1
    # How long a moving node waits for the generations through it before it lets go.
    move_drain_s: float = 10.0
    place_by: str = PLACE_BY_TIME
    # This machine's speed against the mesh's nodes before it has served (--speed-estimate): 0.33
    # is a third as fast as the fastest node that measured its speed; None: probed (one layer).
    speed_estimate: float | None = None
    # The share of the slowest stage's time a range must save: to be taken by a joiner for its
    # speed, and, lasting move_settle_s, for a serving node to move (a move reloads the shard, so
    # it needs more).
    join_min_gain: float = 0.1
    move_min_gain: float = 0.25
    # Placing by time, a node whose stage is found slow gives up the layers faster replicas serve
    # (meshnode.autoplace.slow_yield); off: it keeps them.
    slow_yield: bool = True


__all__ = ["PLACE_BY_MEMORY", "PLACE_BY_TIME", "AutoPlaceConfig"]
