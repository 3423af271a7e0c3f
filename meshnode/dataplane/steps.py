"""Idempotency bookkeeping for one (route_session_id, route_epoch).

Steps are positive and monotonic per session epoch (0 means "unset" and is
refused). The ledger answers one question — what to do with step ``s`` — from
three facts: the highest step admitted, the highest step applied, and a small
bounded record of recently applied steps with what they returned.

Rules:

- ``s`` recorded as applied → replay it: never execute again (the KV cache
  advances once), answer with the stored result, ``duplicate = true``. A record
  whose work id differs means the step number was reused by other work: that is
  a desynchronised sender, refused as CACHE_MISS rather than answered with the
  wrong token.
- ``s`` at or below the highest applied step but not recorded (a step that
  failed and was overtaken, or one too old to remember) → CACHE_MISS: the cache
  has moved past it and only a re-prefill can resynchronise.
- ``s`` more than one past the highest admitted step (a gap) → CACHE_MISS,
  deliberately: the sender believes steps were applied that this worker never
  saw, which is exactly "cache not positioned as expected", and the recovery is
  the same (a re-prefill from position 0). A position-0 prefill is exempt from
  the gap rule so that recovery always works, even after the worker lost the
  session (restart, eviction) while the sender's counter moved on.
- anything else is admitted; a step still queued or running may be admitted
  twice (a retry that overtook the original), and is re-judged at dequeue.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from meshnode.wire.pb import shard


class RecordState(Enum):
    # Applied here; the result is on its way through the next hop.
    FORWARDING = "forwarding"
    # Applied here; the next hop failed, so a retry re-forwards the stored output.
    FORWARD_FAILED = "forward_failed"
    # Applied and answered; a retry gets the stored answer.
    COMPLETE = "complete"


@dataclass(eq=False)
class StepRecord:
    step: int
    work_id: str
    cache_result: shard.CacheResult
    execution_nanos: int
    state: RecordState
    # The result chunk sent to the sender, when there was one.
    result: shard.SessionResponse | None = None
    # What to send the next hop again (kept only until the step completes).
    forward: Any = None
    # Duplicates that arrived while the original was forwarding; answered with it.
    followers: list[Any] = field(default_factory=list)
    # The tail sent the result to the session's head on its answer stream (direct answer): the
    # Acks for this step say so instead of carrying a result.
    answered_directly: bool = False
    # This hop's signed commitment for the step (meshnode.audit), when it makes one, and every
    # commitment its Acks carry: its own, then the next hops' once they answered.
    own_commitment: shard.SignedCommitment | None = None
    commitments: tuple[shard.SignedCommitment, ...] = ()


class Verdict(Enum):
    ADMIT = "admit"
    REPLAY = "replay"
    REUSED_STEP = "reused_step"
    OVERTAKEN = "overtaken"
    GAP = "gap"
    UNSET = "unset"


class StepLedger:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the replay record needs room for at least one step")
        self.capacity = capacity
        self.highest_admitted = 0
        self.highest_applied = 0
        self._records: OrderedDict[int, StepRecord] = OrderedDict()

    def judge(self, step: int, work_id: str, *, fresh_start: bool) -> tuple[Verdict, StepRecord | None]:
        if step == 0:
            return Verdict.UNSET, None
        record = self._records.get(step)
        if record is not None:
            if record.work_id != work_id:
                return Verdict.REUSED_STEP, record
            return Verdict.REPLAY, record
        if step <= self.highest_applied:
            return Verdict.OVERTAKEN, None
        if step > self.highest_admitted + 1 and not fresh_start:
            return Verdict.GAP, None
        return Verdict.ADMIT, None

    def admitted(self, step: int) -> None:
        self.highest_admitted = max(self.highest_admitted, step)

    def applied(self, record: StepRecord) -> None:
        self.highest_applied = max(self.highest_applied, record.step)
        self.highest_admitted = max(self.highest_admitted, record.step)
        self._records[record.step] = record
        self.trim()

    def trim(self) -> None:
        # A forwarding record still owes answers to its followers: never drop it.
        while len(self._records) > self.capacity:
            oldest = next(
                (s for s, r in self._records.items() if r.state is not RecordState.FORWARDING), None
            )
            if oldest is None:
                return
            del self._records[oldest]

    def get(self, step: int) -> StepRecord | None:
        return self._records.get(step)

    def __len__(self) -> int:
        return len(self._records)


__all__ = ["RecordState", "StepLedger", "StepRecord", "Verdict"]
