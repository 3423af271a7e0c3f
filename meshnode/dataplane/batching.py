"""Which ready units go into a shard's next engine batch: bounded, and fair across clients and sessions.

A session's units run one after another (each continues the cache the one before
left), so a batch takes at most one unit per session, the head of its queue. The
worker files every session that has queued units here (:meth:`BatchScheduler.file`,
again whenever its head unit changes) and forms each batch by asking
:meth:`BatchPlan.next` for sessions until it says none, telling the plan which of
them it really ran (:meth:`BatchPlan.accept`; a unit refused before the engine, a
deadline passed say, takes no room). Pure bookkeeping: no clock, no I/O.

The rules:

- **Limits.** At most ``max_units`` units and ``max_tokens`` tokens (a decode is one,
  a prefill chunk its tokens) per batch, the engine's own limits; a unit alone always
  fits, since flow control admitted it and it must run some time.
- **Prefill bound.** At most ``max_prefill_chunks`` (one) prefill chunks per batch,
  taken before the decodes so that a prompt always progresses, while every ready decode
  that fits rides along; when the chunk left ready decodes without room, the next batch
  takes the decodes first (and a chunk after them if one fits). An engine that cannot
  mix them (``mix_prefill`` false) runs a chunk alone, and never two prefill batches in
  a row while decodes wait. Either way a decode waits at most one bounded chunk's
  compute: a long prompt never stalls other sessions' tokens by more.
- **Fairness.** Round robin across owners (the peer whose stream opened a session; this
  node's own head is one owner) and, within an owner, across its sessions: each pick
  sends the owner and the session to the back of their rings. Prefill and decode keep
  rings of their own. So when the limits leave units out, or prompts queue for the one
  chunk a batch takes, a client with many sessions gets one turn per round like a
  client with one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# The prefill chunks one batch carries unless told otherwise.
DEFAULT_MAX_PREFILL_CHUNKS = 1


@dataclass(frozen=True)
class BatchLimits:
    max_units: int
    max_tokens: int
    max_prefill_chunks: int = DEFAULT_MAX_PREFILL_CHUNKS
    # Whether a prefill chunk may share a batch with decodes (one engine call computing both).
    mix_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_units < 1 or self.max_tokens < 1 or self.max_prefill_chunks < 1:
            raise ValueError("batch limits must be positive")


@dataclass(frozen=True, slots=True)
class _Filed:
    owner: Hashable
    decode: bool
    tokens: int


class _Ring:
    """Owners in turn, each with its sessions in turn."""

    def __init__(self) -> None:
        self._owners: OrderedDict[Hashable, OrderedDict[str, None]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._owners)

    def add(self, owner: Hashable, session_id: str) -> None:
        self._owners.setdefault(owner, OrderedDict())[session_id] = None

    def remove(self, owner: Hashable, session_id: str) -> None:
        sessions = self._owners.get(owner)
        if sessions is not None:
            sessions.pop(session_id, None)
            if not sessions:
                del self._owners[owner]

    def any(self, predicate: Callable[[str], bool]) -> bool:
        return any(predicate(s) for sessions in self._owners.values() for s in sessions)

    def pick(self, eligible: Callable[[str], bool]) -> str | None:
        """The first eligible session in turn; it and its owner go to the back of their rings."""
        for owner, sessions in self._owners.items():
            for session_id in sessions:
                if eligible(session_id):
                    sessions.move_to_end(session_id)
                    self._owners.move_to_end(owner)
                    return session_id
        return None


class BatchScheduler:
    """The sessions with a unit ready, and the fairness state that orders them (module docstring)."""

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self._filed: dict[str, _Filed] = {}
        self._rings = {True: _Ring(), False: _Ring()}
        # Set when the last batch was prefill alone (only without mix_prefill).
        self._prefill_ran_alone = False
        # Set when the last batch's chunk left ready decodes without room.
        self._decodes_first = False

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._filed

    def __len__(self) -> int:
        return len(self._filed)

    def file(self, session_id: str, owner: Hashable, *, decode: bool, tokens: int) -> None:
        """``session_id``'s head unit is now a decode (or a prefill chunk) of ``tokens`` tokens.
        A session filed again keeps its place in its ring unless its kind changed."""
        before = self._filed.get(session_id)
        if before is not None and (before.owner, before.decode) != (owner, decode):
            self._rings[before.decode].remove(before.owner, session_id)
            before = None
        self._filed[session_id] = _Filed(owner, decode, tokens)
        if before is None:
            self._rings[decode].add(owner, session_id)

    def remove(self, session_id: str) -> None:
        """``session_id`` has nothing queued any more."""
        filed = self._filed.pop(session_id, None)
        if filed is not None:
            self._rings[filed.decode].remove(filed.owner, session_id)

    def plan(self, max_units: int | None = None) -> BatchPlan:
        """Start forming the next batch; ``max_units`` narrows the limits' own (a pipeline
        cohort's size, meshnode.dataplane.cohorts)."""
        prefills, decodes = self._rings[False], self._rings[True]
        if self.limits.mix_prefill:
            return BatchPlan(self, prefill=True, decode=True, max_units=max_units)
        alone = bool(prefills) and (not decodes or not self._prefill_ran_alone)
        return BatchPlan(self, prefill=alone, decode=not alone, max_units=max_units)


class BatchPlan:
    """One batch being formed: what is in it and how much room is left."""

    def __init__(
        self, scheduler: BatchScheduler, *, prefill: bool, decode: bool, max_units: int | None = None
    ) -> None:
        self.scheduler = scheduler
        self.limits = scheduler.limits
        self.max_units = (
            self.limits.max_units if max_units is None else max(1, min(max_units, self.limits.max_units))
        )
        self.picked: set[str] = set()
        self.units = 0
        self.tokens = 0
        self.prefill_chunks = 0
        self._prefill = prefill
        self._decode = decode
        self._decodes_first = decode and scheduler._decodes_first
        self._formed = False

    def next(self) -> str | None:
        """The next session whose head unit should join, in fair order; None once the batch is formed."""
        if self._formed:
            return None
        session_id = None
        if self.units < self.max_units:
            if self._decodes_first:
                session_id = self._pick_decode() or self._pick_prefill()
            else:
                session_id = self._pick_prefill() or self._pick_decode()
        if session_id is None:
            self._form()
            return None
        self.picked.add(session_id)
        return session_id

    def accept(self, session_id: str) -> None:
        """The unit :meth:`next` named runs in this batch (call it before the session is filed again)."""
        filed = self.scheduler._filed[session_id]
        self.units += 1
        self.tokens += filed.tokens
        if not filed.decode:
            self.prefill_chunks += 1

    @property
    def empty(self) -> bool:
        return self.units == 0

    def _eligible(self, session_id: str) -> bool:
        """Not in this batch yet, and its head unit fits the room left."""
        if session_id in self.picked:
            return False
        filed = self.scheduler._filed[session_id]
        return self.units == 0 or self.tokens + filed.tokens <= self.limits.max_tokens

    def _pick_prefill(self) -> str | None:
        if not self._prefill or self.prefill_chunks >= self.limits.max_prefill_chunks:
            return None
        session_id = self.scheduler._rings[False].pick(self._eligible)
        if session_id is None:
            self._prefill = False  # nothing fits now, and the room only shrinks
        return session_id

    def _pick_decode(self) -> str | None:
        return self.scheduler._rings[True].pick(self._eligible) if self._decode else None

    def _form(self) -> None:
        self._formed = True
        if self.empty:
            return  # nothing ran: the turns stay as they were
        scheduler = self.scheduler
        scheduler._prefill_ran_alone = not self._decode
        # A chunk took room that ready decodes then lacked: they go first next time (the chunk
        # after them if it fits), so neither kind waits on the other for more than one batch.
        left_out = scheduler._rings[True].any(lambda session_id: session_id not in self.picked)
        scheduler._decodes_first = self.prefill_chunks > 0 and left_out


__all__ = ["DEFAULT_MAX_PREFILL_CHUNKS", "BatchLimits", "BatchPlan", "BatchScheduler"]
