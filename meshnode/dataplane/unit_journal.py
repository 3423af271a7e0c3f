"""What a head sent its route's first hop in one epoch, kept to replay it on replicas. Pure.

An audit re-runs a generation's units on other replicas of its ranges and compares what every
hop committed to. A unit's input digest chains the session's whole history, so the replay must
send exactly the units the head sent: the same steps, positions, cache expectations, drafts
and rollbacks, and the same tokens. The journal keeps them, for one epoch of one generation.

A journal that could not be replayed faithfully says so (``replayable``): a unit failed (the
hops' histories then depend on how far it got), the session started from a kept prefix (a
replica holds no such prefix), or the journal outgrew its bound. Such a generation is not
audited. Kept only until the audit decision (the generation's end, or its audit's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from meshnode.dataplane.envelope import UnitPosition

# Units kept a generation epoch: a long generation of single-token decodes.
DEFAULT_MAX_UNITS = 8192


@dataclass(frozen=True, slots=True)
class JournalEntry:
    step: int
    position: UnitPosition
    tokens: np.ndarray | None
    hidden: np.ndarray | None


class UnitJournal:
    def __init__(self, max_units: int = DEFAULT_MAX_UNITS) -> None:
        self.max_units = max_units
        self._entries: list[JournalEntry] = []
        # Why the epoch cannot be replayed (None: it can).
        self.spoiled: str | None = None

    def record(
        self, step: int, position: UnitPosition, tokens: np.ndarray | None, hidden: np.ndarray | None
    ) -> None:
        if self.spoiled is not None:
            return
        if position.prefix_digest:
            self.spoil("the session started from a kept prefix")
            return
        if len(self._entries) >= self.max_units:
            self.spoil(f"more than {self.max_units} units")
            return
        # The block digest only asks the hops to keep a prefix; a replay does not.
        self._entries.append(JournalEntry(step, replace(position, block_digest=b""), tokens, hidden))

    def spoil(self, reason: str) -> None:
        if self.spoiled is None:
            self.spoiled = reason
            self._entries.clear()

    @property
    def replayable(self) -> bool:
        return self.spoiled is None and bool(self._entries)

    @property
    def entries(self) -> tuple[JournalEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["DEFAULT_MAX_UNITS", "JournalEntry", "UnitJournal"]
