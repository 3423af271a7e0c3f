"""The route sessions a shard worker holds: one per route session id at its current epoch, with
its lease, and the epochs of sessions that ended (so a late stream cannot bring one back).

:class:`SessionTable` owns these records and the lease rules (:mod:`.lease`) that end them; it
never sends anything and calls nothing back. The worker asks it which session a unit belongs
to, tells it when a frame or a stream shows the owner is there, and asks it at each timer which
sessions are due to end; what ending a session means on the wire stays with the worker.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from meshnode.dataplane.lease import ReleaseReason, StreamOrigin, idle_timeout_ns
from meshnode.dataplane.payload import HopRole
from meshnode.dataplane.steps import StepLedger
from meshnode.dataplane.worker_state import SessionState, StreamState

# Epochs of sessions dropped recently, so a late stream cannot resurrect an old epoch.
RETIRED_EPOCHS_KEPT = 1024


@dataclass(frozen=True)
class LeaseRules:
    """The worker's lease settings in monotonic nanoseconds (:class:`~.worker.WorkerConfig`)."""

    # A session no frame arrived for in this long ends; a unit's deadline shortens it to no
    # less than the floor.
    idle_ttl_ns: int
    idle_floor_ns: int
    # How long a session whose owner seems gone waits for it.
    owner_grace_ns: int
    # Recently applied steps each session remembers for duplicate replies.
    replay_window: int


class SessionTable:
    def __init__(self, rules: LeaseRules) -> None:
        self.rules = rules
        # Sessions ended, by why (for /metrics).
        self.releases: Counter[ReleaseReason] = Counter()
        self._sessions: dict[str, SessionState] = {}
        self._retired_epochs: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[SessionState]:
        return iter(list(self._sessions.values()))

    def get(self, session_id: str) -> SessionState | None:
        return self._sessions.get(session_id)

    def at_epoch(self, session_id: str, epoch: int) -> SessionState | None:
        """The live session at exactly ``epoch``, if any."""
        session = self._sessions.get(session_id)
        return session if session is not None and session.epoch == epoch else None

    def holds(self, session: SessionState) -> bool:
        """Whether ``session`` is still the live record for its id (not ended, not superseded)."""
        return self._sessions.get(session.session_id) is session

    def epoch_floor(self, session_id: str) -> int:
        """The lowest epoch a stream may still name for ``session_id``."""
        session = self._sessions.get(session_id)
        return session.epoch if session is not None else self._retired_epochs.get(session_id, 0)

    def owners(self) -> set[bytes]:
        """The peers (other than this node) that hold sessions here."""
        return {s.owner.peer_id for s in self._sessions.values() if not s.owner.local}

    def sessions_of(self, peer_id: bytes) -> int:
        """Sessions that ``peer_id`` holds here as a peer (its share's measure)."""
        return sum(1 for s in self._sessions.values() if not s.owner.local and s.owner.peer_id == peer_id)

    def context_tokens(self) -> int:
        """The context budget in use: the positions every session holds or has queued."""
        return sum(s.context_tokens for s in self._sessions.values())

    def create(self, stream: StreamState, epoch: int, role: HopRole, now_ns: int) -> SessionState:
        """A fresh session for ``stream``'s route session at ``epoch``, owned by the stream's
        peer; the caller has ended any older epoch of it first."""
        assert stream.plan is not None and stream.session_id not in self._sessions
        ttl = self.rules.idle_ttl_ns
        fresh = SessionState(
            session_id=stream.session_id,
            epoch=epoch,
            shard_range=stream.shard_range,
            route_bytes=stream.route_bytes,
            plan=stream.plan,
            role=role,
            ledger=StepLedger(self.rules.replay_window),
            last_active_ns=now_ns,
            owner=stream.origin,
            owner_stream=stream.id,
            lease_until_ns=now_ns + ttl,
            idle_timeout_ns=ttl,
        )
        self._sessions[stream.session_id] = fresh
        return fresh

    def remove(self, session: SessionState, reason: ReleaseReason) -> None:
        """Forget ``session``, remembering its epoch so that no stream can reopen it."""
        self.releases[reason] += 1
        del self._sessions[session.session_id]
        self._retired_epochs[session.session_id] = session.epoch
        self._retired_epochs.move_to_end(session.session_id)
        while len(self._retired_epochs) > RETIRED_EPOCHS_KEPT:
            self._retired_epochs.popitem(last=False)

    # ------------------------------------------------------------------ leases

    def touch(self, session: SessionState, stream: StreamState, now_ns: int) -> None:
        """A frame for ``session`` arrived on ``stream``: its lease runs again; from the owner, it
        also shows the owner is there, on that stream."""
        if session.owner == stream.origin:
            session.owner_stream = stream.id
            session.orphaned_until_ns = session.orphan_reason = None
        session.lease_until_ns = now_ns + session.idle_timeout_ns

    def touch_by_signal(self, stream: StreamState, now_ns: int) -> None:
        """A signal (cancel, flow control) on ``stream`` is a frame for the session it serves."""
        session = self.at_epoch(stream.session_id, stream.epoch)
        if session is not None:
            self.touch(session, stream, now_ns)

    def touch_for_unit(
        self, session: SessionState, stream: StreamState, now_ns: int, deadline_at_ns: int | None
    ) -> None:
        """A unit for ``session`` arrived: the lease runs for as long as its sender waits
        (``deadline_at_ns``, monotonic; :func:`~.lease.idle_timeout_ns`; the default without one)."""
        session.idle_timeout_ns = idle_timeout_ns(
            deadline_at_ns, now_ns, default_ns=self.rules.idle_ttl_ns, floor_ns=self.rules.idle_floor_ns
        )
        self.touch(session, stream, now_ns)

    def orphan(self, session: SessionState, now_ns: int, reason: ReleaseReason) -> None:
        """``session``'s owner seems gone: it ends ``owner_grace_ns`` from now unless the owner
        shows up for it. The first sign counts: more of them (each poll of membership) do not
        extend the wait."""
        if session.orphaned_until_ns is None:
            session.orphaned_until_ns = now_ns + self.rules.owner_grace_ns
            session.orphan_reason = reason

    def owned_by(self, origin: StreamOrigin) -> list[SessionState]:
        return [s for s in self._sessions.values() if s.owner == origin]

    def owned_by_peer(self, peer_id: bytes) -> list[SessionState]:
        return [s for s in self._sessions.values() if not s.owner.local and s.owner.peer_id == peer_id]

    def lease_end(self, session: SessionState) -> int:
        # A unit that ran long past its frame's lease still leaves the session the floor after it.
        floor = min(self.rules.idle_floor_ns, self.rules.idle_ttl_ns)
        return max(session.lease_until_ns, session.last_active_ns + floor)

    def due(self, now_ns: int, busy: set[SessionState]) -> list[tuple[SessionState, ReleaseReason, bool]]:
        """The sessions to end at ``now_ns``, with why and whether they are orphans (whose units,
        busy or not, can no longer reach their owner and must be abandoned first). ``busy``:
        the sessions with units in flight, whose idle leases do not run out."""
        ending: list[tuple[SessionState, ReleaseReason, bool]] = []
        for session in self._sessions.values():
            orphaned = session.orphaned_until_ns
            if orphaned is not None and orphaned <= now_ns:
                assert session.orphan_reason is not None
                ending.append((session, session.orphan_reason, True))
            elif session not in busy and self.lease_end(session) <= now_ns:
                ending.append((session, ReleaseReason.IDLE, False))
        return ending

    def next_due(self, busy: set[SessionState]) -> int | None:
        """When :meth:`due` next has a session to end, or ``None``."""
        earliest: int | None = None
        for session in self._sessions.values():  # one pass, no lists: this runs twice a token
            if session not in busy:
                end = self.lease_end(session)
                if earliest is None or end < earliest:
                    earliest = end
            orphaned = session.orphaned_until_ns
            if orphaned is not None and (earliest is None or orphaned < earliest):
                earliest = orphaned
        return earliest


__all__ = ["RETIRED_EPOCHS_KEPT", "LeaseRules", "SessionTable"]
