"""Which route sessions hold cache state, in which slot, and which must be refused.

Pure bookkeeping with time as a parameter: no engine, no clock, no locks. An engine maps
a session's ``slot`` to its own storage (a llama.cpp sequence id, a fake cache entry).

Rules:
- one state per (session_id, epoch); a newer epoch for a session_id displaces the older
  epoch's state, and work for an epoch older than the newest seen is ``EPOCH_STALE``;
- at most ``capacity`` sessions hold state; opening one more displaces the least recently
  used; a state idle longer than ``ttl_s`` expires;
- a cancelled session loses its state and stays refused until a fresh prefill reopens it.

Prefix cache (``prefix_entries`` > 0): a released session that computed whole blocks of the
head's prefill grid is kept, in the slot it held, cut to its last such block: a kept prefix
(``Session.kept``), up to ``prefix_entries`` of them, each dropped after ``prefix_ttl_s``
unused. A new session takes a free slot first, then the least recently used kept prefix's,
and only then a live session's: the cache never pushes out a live session. A session may start
from a kept prefix (:meth:`SessionTable.open_from_prefix`): it adopts the prefix's slot when the
prefix holds no more than it needs, and otherwise copies it into a slot of its own, so that the
longer prefix stays for the next (a shared system prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
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
    # The blocks of the head's prefill grid this session computed, each as one prefill chunk
    # carrying its digest: (end position, digest of every token before it), from position 0
    # without a gap. Only these positions may outlive the session (decode-written ones may not:
    # a one-row pass rounds otherwise than the chunk a fresh prefill computes them in).
    blocks: list[tuple[int, bytes]] = field(default_factory=list)
    # A kept prefix (a released session's blocks) rather than a live session.
    kept: bool = False

    @property
    def blocks_end(self) -> int:
        """Where the unbroken run of blocks ends (0: none)."""
        return self.blocks[-1][0] if self.blocks else 0

    def record_block(self, first_position: int, end: int, digest: bytes) -> None:
        """A prefill chunk [first_position, end) carrying ``digest`` was committed: it extends the
        blocks only when it starts where they end."""
        if digest and first_position == self.blocks_end and end > first_position:
            self.blocks.append((end, digest))

    def cut_blocks(self, length: int) -> None:
        """The session now holds ``length`` positions: blocks past it are gone."""
        if self.blocks_end > length:
            self.blocks = [block for block in self.blocks if block[0] <= length]

    def holds_prefix(self, length: int, digest: bytes) -> bool:
        return (length, digest) in self.blocks


@dataclass(frozen=True, slots=True)
class PrefixStart:
    """A session opened from a kept prefix: the session, which prefix it came from, whether it
    copies it (``False``: it adopted the prefix's slot), and what was pushed out to make room."""

    session: Session
    source: Session
    copied: bool
    evicted: list[Session]


class SessionTable:
    def __init__(
        self,
        capacity: int,
        ttl_s: float,
        memory: int = _DEFAULT_MEMORY,
        *,
        prefix_entries: int = 0,
        prefix_ttl_s: float = 600.0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if prefix_entries < 0:
            raise ValueError("prefix_entries must not be negative")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.prefix_entries = prefix_entries
        self.prefix_ttl_s = prefix_ttl_s
        self._memory = memory
        # Least recently used first.
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        # Kept prefixes by slot, least recently used first.
        self._kept: OrderedDict[int, Session] = OrderedDict()
        self._free_slots = set(range(capacity))
        self._newest_epoch: OrderedDict[str, int] = OrderedDict()
        self._cancelled: OrderedDict[SessionKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def kept(self) -> list[Session]:
        """The kept prefixes, least recently used first."""
        return list(self._kept.values())

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
        slot = self._take_slot(displaced, live_too=True)
        assert slot is not None
        session = Session(key, slot, start_layer, past_len=0, last_used=now)
        self._sessions[key] = session
        return session, displaced

    def open_from_prefix(
        self, key: SessionKey, start_layer: int, length: int, digest: bytes, now: float
    ) -> PrefixStart | None:
        """State for ``key`` holding the kept prefix of ``length`` positions named ``digest``
        (computed from ``start_layer``); None when no such prefix is kept. The caller makes the
        slot hold it: copies ``source``'s slot and cuts the copy, or cuts the adopted slot, to
        ``length``; and frees what was evicted."""
        matches = [
            kept
            for kept in self._kept.values()
            if kept.start_layer == start_layer and kept.holds_prefix(length, digest)
        ]
        if not matches:
            return None
        # One that holds no more than asked is adopted whole; else the most recently used.
        source = next((kept for kept in matches if kept.blocks_end == length), matches[-1])
        del self._kept[source.slot]
        evicted: list[Session] = []
        slot = None
        if source.blocks_end > length:
            # Keep the longer prefix for later when a slot is free without a live session going.
            slot = self._take_slot(evicted, live_too=False)
        copied = slot is not None
        if slot is None:
            slot = source.slot
        else:
            self._kept[source.slot] = source
            source.last_used = now
        self._cancelled.pop(key, None)
        session = Session(
            key,
            slot,
            start_layer,
            past_len=length,
            committed_len=length,
            last_used=now,
            blocks=[block for block in source.blocks if block[0] <= length],
        )
        self._sessions[key] = session
        return PrefixStart(session, source, copied, evicted)

    def release(self, key: SessionKey, now: float) -> tuple[Session | None, list[Session]]:
        """End ``key``'s state. Returns it (None: none was held) and the kept prefixes pushed out.

        With the prefix cache on, a session holding blocks is kept in its slot, cut to its last
        block (``Session.kept``; the caller cuts the storage to ``blocks_end``); one whose blocks
        another kept prefix already holds is not kept twice, and a kept prefix that the released
        session's blocks hold is replaced by it."""
        session = self._sessions.pop(key, None)
        if session is None:
            return None, []
        if not self.prefix_entries or not session.blocks:
            self._free_slots.add(session.slot)
            return session, []
        session.cut_blocks(session.past_len)
        end, digest = session.blocks[-1]
        evicted: list[Session] = []
        for other in list(self._kept.values()):
            if other.start_layer != session.start_layer:
                continue
            if other.holds_prefix(end, digest):
                # Already kept (as long or longer): this one adds nothing.
                other.last_used = now
                self._kept.move_to_end(other.slot)
                self._free_slots.add(session.slot)
                return session, []
            if session.holds_prefix(other.blocks_end, other.blocks[-1][1]):
                evicted.append(self._evict(other.slot))
        session.kept = True
        session.past_len = session.committed_len = end
        session.last_used = now
        self._kept[session.slot] = session
        while len(self._kept) > self.prefix_entries:
            evicted.append(self._evict(next(iter(self._kept))))
        return session, evicted

    def drop_kept(self) -> list[Session]:
        """Every kept prefix, gone (the caller empties their slots)."""
        return [self._evict(slot) for slot in list(self._kept)]

    def _take_slot(self, displaced: list[Session], *, live_too: bool) -> int | None:
        """A free slot, else a kept prefix's, else (``live_too``) the least recently used live
        session's; what had it goes to ``displaced``. None: no slot without a live session going."""
        if not self._free_slots and self._kept:
            displaced.append(self._evict(next(iter(self._kept))))
        if not self._free_slots:
            if not live_too or not self._sessions:
                return None
            _, victim = self._sessions.popitem(last=False)
            self._free_slots.add(victim.slot)
            displaced.append(victim)
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        return slot

    def _evict(self, slot: int) -> Session:
        kept = self._kept.pop(slot)
        self._free_slots.add(slot)
        return kept

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
        """Live sessions idle past ``ttl_s`` and kept prefixes unused past ``prefix_ttl_s``, gone."""
        expired = [s for s in self._sessions.values() if now - s.last_used > self.ttl_s]
        for session in expired:
            self._drop(session.key)
        stale = [kept.slot for kept in self._kept.values() if now - kept.last_used > self.prefix_ttl_s]
        return expired + [self._evict(slot) for slot in stale]

    def remove_where_start(self, start_layer: int) -> list[Session]:
        doomed = [s for s in self._sessions.values() if s.start_layer == start_layer]
        for session in doomed:
            self._drop(session.key)
        kept = [slot for slot, prefix in self._kept.items() if prefix.start_layer == start_layer]
        return doomed + [self._evict(slot) for slot in kept]

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
