"""What the worker machine asks its edge to do. Small frozen values; the edge only carries them out.

Engine actions (:class:`RunBatch`, :class:`ReleaseEngine`) must run on one engine
thread in the order they were emitted; :class:`FireCancel` may run anywhere,
immediately. Everything else is I/O on the stream or next-hop session named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.interface import BatchStep, CancelToken, SessionKey, ShardEngine, StepOutcome
from meshnode.dataplane.envelope import Deadline, UnitPosition
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.pb import shard


@dataclass(frozen=True, slots=True)
class Send:
    """Write ``response`` as one frame on stream ``stream_id``."""

    stream_id: int
    response: shard.SessionResponse


@dataclass(frozen=True, slots=True)
class CloseStream:
    """Finish the stream after the frames already sent (a terminal status went first)."""

    stream_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run units of several sessions (at most one each) in one engine call, ``steps[i]`` being
    unit ``unit_ids[i]``; report with ``ShardWorker.batch_finished(batch_id, outcomes, ...)``."""

    batch_id: int
    unit_ids: tuple[int, ...]
    steps: tuple[BatchStep, ...]

    def execute(self, engine: ShardEngine) -> list[StepOutcome]:
        return engine.step_batch(self.steps)


@dataclass(frozen=True, slots=True)
class FireCancel:
    """Abandon a running unit (deadline, cancel, release, newer epoch). Safe from any thread."""

    unit_id: int
    token: CancelToken


@dataclass(frozen=True, slots=True)
class ReleaseEngine:
    """Drop the engine's state for ``session`` (``engine.release``); nothing to report back."""

    session: SessionKey


@dataclass(frozen=True, slots=True)
class ForwardWork:
    """One unit for the next hop, in the engine's terms; the client encodes it for that hop."""

    step: int
    work_id: str
    # The unit's own position: the next hop's cache must hold what this hop's did.
    position: UnitPosition
    # The deadline it arrived with, passed on unchanged.
    deadline: Deadline | None
    hidden: np.ndarray
    # This hop's signed statement of ``hidden`` (meshnode.audit.handoff); None: it states none.
    handoff: shard.SignedHandoff | None = None


@dataclass(frozen=True, slots=True)
class Forward:
    """Send ``work`` to ``hop`` within ``session``, opening it with ``route`` if needed.

    Report the outcome with ``ShardWorker.downstream_finished(unit_id, ...)``.
    """

    unit_id: int
    session: SessionKey
    hop: dataplane.RouteHop
    route: dataplane.SessionRoute
    work: ForwardWork


@dataclass(frozen=True)
class DownstreamResult:
    """A :class:`Forward`'s outcome when the next hop took it: its result tensors, if any, or word
    that the tail sent the result to the session's head directly (``answered_directly``)."""

    bundle: shard.TensorBundle | None = None
    answered_directly: bool = False
    # The signed commitments the next hop's Ack carried (its own and those after it), unchecked.
    commitments: tuple[shard.SignedCommitment, ...] = ()


@dataclass(frozen=True, slots=True)
class CancelDownstream:
    """Pass a cancel on to the next hop of ``session`` (empty ``work_id``: every unit)."""

    session: SessionKey
    work_id: str


@dataclass(frozen=True, slots=True)
class ReleaseDownstream:
    """Pass a release on to the next hop of ``session`` and drop the client for it."""

    session: SessionKey


Action = (
    Send
    | CloseStream
    | RunBatch
    | FireCancel
    | ReleaseEngine
    | Forward
    | CancelDownstream
    | ReleaseDownstream
)

__all__ = [
    "Action",
    "CancelDownstream",
    "CloseStream",
    "DownstreamResult",
    "FireCancel",
    "Forward",
    "ForwardWork",
    "ReleaseDownstream",
    "ReleaseEngine",
    "RunBatch",
    "Send",
]
