"""The head's record of the commitments its routes' hops signed, bounded in time and count. Pure.

Commitments ride back on the Acks of every unit (:mod:`meshnode.audit.commitment`); an audit
reads a generation's after the fact. They are kept as they arrived, unchecked: a signature is
checked only when an audit reads it, so a token costs the head no verification. Nothing here
grows without bound: a generation keeps at most ``max_per_session`` (its first ones: the
history an audit replays starts there), the store at most ``max_total`` (the generations
least recently added to go first), and none outlives ``window_ns`` after its last addition.
Time is the ``now_ns`` argument (monotonic nanoseconds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import shard

DEFAULT_WINDOW_NS = 600 * SECOND_NS
# A few hundred bytes each: 4,096 is a long generation on a route of several hops, and the total
# about 20 MB.
DEFAULT_MAX_PER_SESSION = 4096
DEFAULT_MAX_TOTAL = 65_536


@dataclass
class _Kept:
    commitments: list[shard.SignedCommitment] = field(default_factory=list)
    last_added_ns: int = 0
    # Commitments that arrived after the session's share was full (so an audit knows it is partial).
    dropped: int = 0


@dataclass(frozen=True)
class SessionCommitments:
    commitments: tuple[shard.SignedCommitment, ...]
    # True when some arrived past the session's cap and were not kept.
    truncated: bool


class CommitmentStore:
    def __init__(
        self,
        *,
        window_ns: int = DEFAULT_WINDOW_NS,
        max_per_session: int = DEFAULT_MAX_PER_SESSION,
        max_total: int = DEFAULT_MAX_TOTAL,
    ) -> None:
        if max_per_session < 1 or max_total < max_per_session:
            raise ValueError("the store needs room for at least one session's commitments")
        self.window_ns = window_ns
        self.max_per_session = max_per_session
        self.max_total = max_total
        self._sessions: OrderedDict[str, _Kept] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def session_ids(self) -> list[str]:
        """The sessions kept, least recently added first."""
        return list(self._sessions)

    def add(self, session_id: str, commitments: Iterable[shard.SignedCommitment], now_ns: int) -> None:
        """Keep what one Ack of ``session_id`` (the head's own name for the generation) carried."""
        self.expire(now_ns)
        kept = self._sessions.get(session_id)
        if kept is None:
            kept = self._sessions[session_id] = _Kept()
        else:
            self._sessions.move_to_end(session_id)
        kept.last_added_ns = now_ns
        for signed in commitments:
            if len(kept.commitments) >= self.max_per_session:
                kept.dropped += 1
                continue
            kept.commitments.append(signed)
            self._total += 1
        while self._total > self.max_total:
            _oldest, evicted = self._sessions.popitem(last=False)
            self._total -= len(evicted.commitments)

    def session(self, session_id: str, now_ns: int) -> SessionCommitments | None:
        """What is kept of ``session_id``, or None when nothing is (never kept, or gone)."""
        self.expire(now_ns)
        kept = self._sessions.get(session_id)
        if kept is None:
            return None
        return SessionCommitments(tuple(kept.commitments), kept.dropped > 0)

    def forget(self, session_id: str) -> None:
        kept = self._sessions.pop(session_id, None)
        if kept is not None:
            self._total -= len(kept.commitments)

    def expire(self, now_ns: int) -> None:
        # Ordered by last addition, so the expired ones are at the front.
        while self._sessions:
            session_id, kept = next(iter(self._sessions.items()))
            if now_ns - kept.last_added_ns < self.window_ns:
                return
            self.forget(session_id)


__all__ = [
    "DEFAULT_MAX_PER_SESSION",
    "DEFAULT_MAX_TOTAL",
    "DEFAULT_WINDOW_NS",
    "CommitmentStore",
    "SessionCommitments",
]
