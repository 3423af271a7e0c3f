"""How a node places itself (:class:`AutoPlaceConfig`), apart from the placement loop so that
the command line reads it without loading it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


__all__ = ["AutoPlaceConfig"]
