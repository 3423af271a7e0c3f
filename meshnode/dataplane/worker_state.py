"""The worker machine's own records: one per stream, per route session, per unit of work.

Plain mutable dataclasses owned by :class:`~meshnode.dataplane.worker.ShardWorker`;
nothing outside the worker changes them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engines.interface import CancelToken, SessionKey
from meshnode.dataplane.envelope import Deadline, UnitPosition
from meshnode.dataplane.lease import LOCAL_ORIGIN, ReleaseReason, StreamOrigin
from meshnode.dataplane.payload import HopRole, StepInput
from meshnode.dataplane.route import RoutePlan
from meshnode.dataplane.steps import StepLedger, StepRecord
from meshnode.wire.pb import shard


class StreamPhase(Enum):
    AWAIT_ROUTE = "await_route"
    AWAIT_OPEN = "await_open"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False)
class StreamState:
    id: int
    origin: StreamOrigin = LOCAL_ORIGIN
    phase: StreamPhase = StreamPhase.AWAIT_ROUTE
    plan: RoutePlan | None = None
    route_bytes: bytes = b""
    session_id: str = ""
    epoch: int = 0
    shard_range: tuple[int, int, int] = (0, 0, 0)
    schema_version: int = 0
    flow: shard.FlowControl | None = None
    window: int = 0
    unacked: int = 0
    result_compression: int = shard.COMPRESSION_NONE
    # An answer stream (SessionOpen.answer_stream): it carries the tail's direct answers for its
    # session to the head that opened it, and no work.
    answer_only: bool = False


@dataclass(eq=False)
class SessionState:
    session_id: str
    epoch: int
    shard_range: tuple[int, int, int]
    route_bytes: bytes
    plan: RoutePlan
    role: HopRole
    ledger: StepLedger
    last_active_ns: int
    # The opener: its departure from the mesh ends the session, and so does the loss of the
    # link that `owner_stream`, its latest stream for the session, came over.
    owner: StreamOrigin
    owner_stream: int
    # The session ends once no frame arrived by then (and nothing of it is in flight).
    lease_until_ns: int
    # How long the lease runs from a frame; set by each unit from its deadline (.lease).
    idle_timeout_ns: int
    # Set when the owner seemed gone (its link lost, or membership dropped it): the session ends
    # then, for `orphan_reason`, unless a frame or a stream from the owner shows it is still there.
    orphaned_until_ns: int | None = None
    orphan_reason: ReleaseReason | None = None
    # Tokens the engine holds for this session; None when unknown (the engine then decides).
    past_len: int | None = 0
    # Of past_len, those that are not uncommitted drafts of the last verify step: how far a
    # rollback may go (engines.interface.rollback_refusal); None when unknown, as past_len.
    committed_len: int | None = 0
    # Highest position admitted since the last fresh start (the context budget's unit).
    context_tokens: int = 0
    # The input digest of the last unit applied here since a fresh start (meshnode.audit.commitment's
    # chain); None when there is none or the history is not known (an engine failure): then no
    # commitment is made until the next fresh start.
    audit_chain: bytes | None = None
    # Whether the hop before this one sent a handoff with a unit of this session
    # (meshnode.audit.handoff): from then on every unit needs one (handoff_check).
    upstream_states_handoffs: bool = False
    queue: deque[Unit] = field(default_factory=deque)

    @property
    def key(self) -> SessionKey:
        return SessionKey(self.session_id, self.epoch)


@dataclass(eq=False)
class Unit:
    id: int
    stream_id: int
    session: SessionState
    step: int
    work_id: str
    position: UnitPosition
    deadline: Deadline | None
    input: StepInput | None
    # When it arrived (monotonic ns): its queue wait runs from here to its batch's start.
    arrived_ns: int = 0
    token: CancelToken | None = None
    answered: bool = False
    record: StepRecord | None = None
    # Answered from the replay record (a duplicate), not by running the engine.
    replay: bool = False
    # The chained input digest this unit commits to, once prepared (None: it makes no commitment).
    input_digest: bytes | None = None
    # The previous hop's signed statement of this unit's input, checked against it on arrival
    # (meshnode.audit.handoff); carried in this hop's commitment. None: it sent none.
    input_handoff: shard.SignedHandoff | None = None


@dataclass(eq=False)
class RunningBatch:
    """The units the engine is computing together, one per session."""

    id: int
    units: list[Unit]


__all__ = ["RunningBatch", "SessionState", "StreamPhase", "StreamState", "Unit"]
