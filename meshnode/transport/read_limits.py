"""What a stream's reader may hold of incomplete frames, and for how long.

Every link carries one :class:`ReadLimits` that its streams share: a buffer
budget for the connection (a child of the one budget for the whole process)
and a stall timeout. :class:`~meshnode.transport.framed.FramedStream` applies
them: body bytes of an incomplete frame are charged to the connection's budget
as they arrive, and a reader waiting in the middle of a frame gives up after
the stall timeout. Either way the stream is given up with a typed framing
error, counted here by reason, and the reader's owner resets it with its
protocol's code (``MESH_ERROR_BUFFER_LIMIT`` / ``MESH_ERROR_FRAME_STALLED``
on mesh streams, the ``RELAY_ERROR_`` equivalents on the relay).

The stall timer only runs while a reader is waiting for bytes: a stream whose
reader is busy elsewhere is not stalled, its sender is held back by flow
control instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from meshnode.wire.buffer_budget import BufferBudget, BufferScope

MiB = 1024 * 1024
# Eight maximal (8 MiB) frames in progress at once on one connection.
DEFAULT_CONNECTION_BUFFER_BYTES = 64 * MiB
DEFAULT_PROCESS_BUFFER_BYTES = 256 * MiB
# Longer than any pause of an honest sender mid-frame; shorter than a QUIC idle timeout
# would let a silent peer pin its buffers (keepalive PINGs keep the link itself up).
DEFAULT_STALL_TIMEOUT_S = 30.0


class ResetReason(StrEnum):
    CONNECTION_BUFFER = "connection_buffer"
    PROCESS_BUFFER = "process_buffer"
    STALLED = "stalled"


_PROCESS_BUDGET = BufferBudget(DEFAULT_PROCESS_BUFFER_BYTES, scope=BufferScope.PROCESS)
# What links that carry no settings of their own (relayed links) get; set with the process cap.
_connection_defaults: tuple[int, float | None] = (DEFAULT_CONNECTION_BUFFER_BYTES, DEFAULT_STALL_TIMEOUT_S)
# Streams given up on, by reason, in this process.
_RESETS: Counter[ResetReason] = Counter()


def process_budget() -> BufferBudget:
    """The budget all connections of this process share."""
    return _PROCESS_BUDGET


def configure_process(
    total_bytes: int,
    connection_bytes: int = DEFAULT_CONNECTION_BUFFER_BYTES,
    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
) -> None:
    """Set at start-up from configuration (the node's and the relay's ``--frame-buffer-*`` options).

    ``total_bytes`` caps all connections together; the other two are what
    :meth:`ReadLimits.for_connection` gives a link whose transport has no
    settings of its own (QUIC links take theirs from ``QuicConfig``).
    """
    global _connection_defaults
    if total_bytes <= 0 or connection_bytes <= 0:
        raise ValueError("frame buffer limits must be positive")
    _PROCESS_BUDGET.limit = total_bytes
    _connection_defaults = (connection_bytes, stall_timeout)


def count_reset(reason: ResetReason) -> None:
    _RESETS[reason] += 1


def reset_counts() -> dict[str, int]:
    """Streams given up on so far, by reason (every reason present, zeros included)."""
    return {str(reason): _RESETS[reason] for reason in ResetReason}


def reason_for_scope(scope: str) -> ResetReason:
    return ResetReason.PROCESS_BUFFER if scope == BufferScope.PROCESS else ResetReason.CONNECTION_BUFFER


@dataclass(frozen=True)
class ReadLimits:
    budget: BufferBudget | None = None
    stall_timeout: float | None = None

    @classmethod
    def for_connection(cls) -> ReadLimits:
        """A new connection's limits as configured for the process (see :func:`configure_process`)."""
        connection_bytes, stall_timeout = _connection_defaults
        return cls(budget=_PROCESS_BUDGET.child(connection_bytes), stall_timeout=stall_timeout)


__all__ = [
    "DEFAULT_CONNECTION_BUFFER_BYTES",
    "DEFAULT_PROCESS_BUFFER_BYTES",
    "DEFAULT_STALL_TIMEOUT_S",
    "ReadLimits",
    "ResetReason",
    "configure_process",
    "count_reset",
    "process_budget",
    "reason_for_scope",
    "reset_counts",
]
