"""The sessions this head holds on each shard, so its own new sessions spread before gossip catches up.

A shard's load reaches the head in its gossip record, refreshed once a
heartbeat; a burst of requests at this head would all see the same stale
numbers and pile onto one replica. The head knows the sessions it opened
itself, and a shard holds at least those: the planner takes the larger of the
two counts. The larger, not the sum: once gossip is fresh its count already
includes this head's sessions. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

from meshnode.head.planner import ShardCandidate


class SessionLedger:
    def __init__(self) -> None:
        self._held: Counter[bytes] = Counter()

    def hold(self, node_ids: Iterable[bytes]) -> None:
        self._held.update(node_ids)

    def release(self, node_ids: Iterable[bytes]) -> None:
        self._held.subtract(node_ids)
        self._held = +self._held  # drops counts at zero

    def held(self, node_id: bytes) -> int:
        return self._held[node_id]

    def adjust(self, candidates: Iterable[ShardCandidate]) -> list[ShardCandidate]:
        """The candidates with each one's active sessions at least this head's own there."""
        adjusted = []
        for candidate in candidates:
            own = self._held[candidate.node_id]
            if own > candidate.active_sessions:
                candidate = dataclasses.replace(candidate, active_sessions=own)
            adjusted.append(candidate)
        return adjusted


__all__ = ["SessionLedger"]
