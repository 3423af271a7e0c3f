"""Which route sessions hold cache state, in which slot, and which must be refused.

Pure bookkeeping with time as a parameter: no engine, no clock, no locks. An engine maps
a session's ``slot`` to its own storage (a llama.cpp sequence id, a fake cache entry).

Rules:
- one state per (session_id, epoch); a newer epoch for a session_id displaces the older
  epoch's state, and work for an epoch older than the newest seen is ``EPOCH_STALE``;
- at most ``capacity`` sessions hold state; opening one more displaces the least recently
  used; a state idle longer than ``ttl_s`` expires;
- a cancelled session loses its state and stays refused until a fresh prefill reopens it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from engines.interface import EngineError, EngineErrorKind, SessionKey

K = TypeVar("K")
V = TypeVar("V")

# How many session ids' newest epochs and cancellations are remembered after their state is gone.
_DEFAULT_MEMORY = 4096


@dataclass
class Session:
    key: SessionKey
    slot: int
    # The layer this session's execution starts at (the loaded start or an effective start).
    start_layer: int
    past_len: int = 0
    # Of past_len, the tokens that are not drafts of the last verify step: a rollback
    # (StepRequest.rollback) may drop positions down to this, never below.
    committed_len: int = 0
    last_used: float = 0.0


class SessionTable:
    def __init__(self, capacity: int, ttl_s: float, memory: int = _DEFAULT_MEMORY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._memory = memory
        # Least recently used first.
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self._free_slots = set(range(capacity))
        self._newest_epoch: OrderedDict[str, int] = OrderedDict()
        self._cancelled: OrderedDict[SessionKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def lookup(self, key: SessionKey) -> Session | None:
        return self._sessions.get(key)

    def is_cancelled(self, key: SessionKey) -> bool:
        return key in self._cancelled

    def admit_epoch(self, key: SessionKey) -> list[Session]:
        """Refuse a stale epoch; on a newer one, displace the session's older-epoch states."""
        newest = self._newest_epoch.get(key.session_id)
        if newest is not None and key.epoch < newest:
            raise EngineError(
                EngineErrorKind.EPOCH_STALE,
                f"session {key.session_id!r} is at epoch {newest}, refusing epoch {key.epoch}",
            )
        self._remember(self._newest_epoch, key.session_id, key.epoch)
        if newest is None or key.epoch == newest:
            return []
        older = [
            s for k, s in self._sessions.items() if k.session_id == key.session_id and k.epoch < key.epoch
        ]
        for session in older:
            self._drop(session.key)
        return older

    def open(self, key: SessionKey, start_layer: int, now: float) -> tuple[Session, list[Session]]:
        """Fresh, empty state for ``key`` (a prefill at position 0).

        Returns the session and the states displaced to make room (their storage must be
        freed). An existing state for ``key`` is reset in place and reported as displaced
        so its storage is cleared too.
        """
        self._cancelled.pop(key, None)
        displaced = []
        existing = self._sessions.pop(key, None)
        if existing is not None:
            self._free_slots.add(existing.slot)
            displaced.append(existing)
        if not self._free_slots:
            _, victim = self._sessions.popitem(last=False)
            self._free_slots.add(victim.slot)
            displaced.append(victim)
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        session = Session(key, slot, start_layer, past_len=0, last_used=now)
        self._sessions[key] = session
        return session, displaced

    def touch(self, session: Session, now: float) -> None:
        session.last_used = now
        self._sessions.move_to_end(session.key)

    def remove(self, key: SessionKey) -> Session | None:
        return self._drop(key)

    def cancel(self, key: SessionKey) -> Session | None:
        """Refuse the session until its next fresh prefill; returns the state it held."""
        self._remember(self._cancelled, key, None)
        return self._drop(key)

    def expire(self, now: float) -> list[Session]:
        expired = [s for s in self._sessions.values() if now - s.last_used > self.ttl_s]
        for session in expired:
            self._drop(session.key)
        return expired

    def remove_where_start(self, start_layer: int) -> list[Session]:
        doomed = [s for s in self._sessions.values() if s.start_layer == start_layer]
        for session in doomed:
            self._drop(session.key)
        return doomed

    def _drop(self, key: SessionKey) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._free_slots.add(session.slot)
        return session

    def _remember(self, memory: OrderedDict[K, V], key: K, value: V) -> None:
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > self._memory:
            memory.popitem(last=False)
