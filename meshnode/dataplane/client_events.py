"""What a session's sender tells its edge: the session ready or failed, each unit done or failed.

The events :meth:`SessionClient.take_events <meshnode.dataplane.client.SessionClient.take_events>`
drains, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import WireTensor, decode_bundle


@dataclass(frozen=True, slots=True)
class SessionReady:
    accepted: shard.SessionAccepted


@dataclass(frozen=True, slots=True)
class UnitDone:
    unit_id: int
    step: int
    work_id: str
    # Result tensors the peer returned (the tail's token, or a hidden state), if any.
    bundle: shard.TensorBundle | None
    cache_result: shard.CacheResult
    duplicate: bool
    execution_nanos: int
    # The tail sent the result to the session's head, not back along the route: for a forwarding
    # hop, ``bundle`` is then None; for the head, the result came on its answer stream.
    answered_directly: bool = False
    # The signed commitments the Ack carried (meshnode.audit), unchecked; empty when the unit was
    # done by its direct answer ahead of the Ack (they come as UnitCommitted then).
    commitments: tuple[shard.SignedCommitment, ...] = ()

    def tensors(self) -> dict[str, WireTensor]:
        """Decode (and checksum-verify) the result; PayloadCorrupt if it does not decode."""
        return {} if self.bundle is None else decode_bundle(self.bundle)


@dataclass(frozen=True, slots=True)
class UnitCommitted:
    """The Ack of a unit already done (its direct answer came first) carried signed commitments."""

    step: int
    work_id: str
    commitments: tuple[shard.SignedCommitment, ...]


@dataclass(frozen=True, slots=True)
class UnitFailed:
    unit_id: int
    step: int
    work_id: str
    # ShardProtocolError (the worker, or a local check, refused) or SessionTransportError.
    error: MeshnodeError


@dataclass(frozen=True, slots=True)
class SessionFailed:
    """The session is over: a terminal status from the peer (a ``ShardProtocolError``), or the edge
    gave up on the transport (:meth:`SessionClient.abandon`). Every open unit failed with it."""

    error: MeshnodeError


@dataclass(frozen=True, slots=True)
class PeerRefusal:
    """A non-terminal status not tied to a unit (e.g. a signal the worker refused)."""

    error: ShardProtocolError


ClientEvent = SessionReady | UnitDone | UnitCommitted | UnitFailed | SessionFailed | PeerRefusal


__all__ = [
    "ClientEvent",
    "PeerRefusal",
    "SessionFailed",
    "SessionReady",
    "UnitCommitted",
    "UnitDone",
    "UnitFailed",
]
