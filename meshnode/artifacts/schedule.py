"""Which source fetches which tensor next: a pure work queue, and the quarantine of liars.

:class:`FetchPlan` holds the tensors still wanted, those in flight and who holds what.
A source takes the first pending tensor it holds; a tensor that fails comes back to
the front of the queue for another source; a source that is lost or quarantined takes
nothing more. The fetcher's workers only ask it and do what it says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from meshnode.identity import short_id

log = logging.getLogger(__name__)


class Quarantine:
    """Peers caught sending bytes that do not match the manifest: not asked again in this fetch."""

    def __init__(self) -> None:
        self._reasons: dict[bytes, str] = {}

    def add(self, peer_id: bytes, reason: str) -> None:
        if peer_id not in self._reasons:
            log.warning("quarantined peer %s: %s", short_id(peer_id), reason)
        self._reasons.setdefault(peer_id, reason)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._reasons

    @property
    def peers(self) -> dict[bytes, str]:
        return dict(self._reasons)


class FetchPlan:
    def __init__(self, wanted: Iterable[int], holders: Mapping[bytes, frozenset[int]]) -> None:
        self.pending: list[int] = list(dict.fromkeys(wanted))
        self.in_flight: dict[int, bytes] = {}
        self.done: dict[int, bytes] = {}
        self._holds: dict[bytes, set[int]] = {source: set(held) for source, held in holders.items()}
        self.lost: dict[bytes, str] = {}

    def is_live(self, source: bytes) -> bool:
        return source in self._holds and source not in self.lost

    def take(self, source: bytes) -> int | None:
        """The next tensor ``source`` should fetch (now in flight), or ``None`` for nothing now."""
        if not self.is_live(source):
            return None
        held = self._holds[source]
        for position, index in enumerate(self.pending):
            if index in held:
                del self.pending[position]
                self.in_flight[index] = source
                return index
        return None

    def may_get_work(self, source: bytes) -> bool:
        """Whether ``source`` could still be given a tensor: one pending, or one in flight
        elsewhere that may come back, that it holds."""
        if not self.is_live(source):
            return False
        held = self._holds[source]
        return any(i in held for i in self.pending) or any(
            i in held and s != source for i, s in self.in_flight.items()
        )

    def succeeded(self, index: int, source: bytes) -> None:
        self.in_flight.pop(index, None)
        self.done[index] = source

    def give_back(self, index: int, *, not_held_by: bytes | None = None) -> None:
        """Return an in-flight tensor to the front of the queue (optionally: that source lacks it)."""
        self.in_flight.pop(index, None)
        if index not in self.done and index not in self.pending:
            self.pending.insert(0, index)
        if not_held_by is not None and not_held_by in self._holds:
            self._holds[not_held_by].discard(index)

    def lose(self, source: bytes, reason: str) -> None:
        """``source`` takes nothing more (failed, disconnected, quarantined)."""
        self.lost.setdefault(source, reason)

    @property
    def finished(self) -> bool:
        return not self.pending and not self.in_flight

    def unobtainable(self) -> list[int]:
        """Pending tensors no live source holds."""
        live = [held for source, held in self._holds.items() if self.is_live(source)]
        return [i for i in self.pending if not any(i in held for held in live)]


__all__ = ["FetchPlan", "Quarantine"]
