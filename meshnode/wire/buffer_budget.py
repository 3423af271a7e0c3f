"""Caps on the bytes held in incomplete frames, sans-IO.

A :class:`~meshnode.wire.framing.FrameDecoder` holds the bytes of a frame that
has not fully arrived. Each decoder charges them to a budget: one per
connection, whose parent is one for the whole process, so neither one peer's
streams nor all peers together can make a node hold more than the caps. A
charge that would pass any cap on the chain is refused whole, before anything
is held, with :class:`~meshnode.wire.errors.BufferLimitExceeded` naming the
scope that was full.
"""

from __future__ import annotations

from enum import StrEnum

from meshnode.wire.errors import BufferLimitExceeded


class BufferScope(StrEnum):
    CONNECTION = "connection"
    PROCESS = "process"


class BufferBudget:
    def __init__(self, limit: int, *, scope: BufferScope, parent: BufferBudget | None = None) -> None:
        if limit < 0:
            raise ValueError("a buffer limit must not be negative")
        self.limit = limit
        self.scope = scope
        self.parent = parent
        self.held = 0

    def child(self, limit: int, scope: BufferScope = BufferScope.CONNECTION) -> BufferBudget:
        return BufferBudget(limit, scope=scope, parent=self)

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` more here and in every parent, or raise without holding any."""
        budget: BufferBudget | None = self
        while budget is not None:
            if budget.held + nbytes > budget.limit:
                raise BufferLimitExceeded(budget.scope, budget.held, nbytes, budget.limit)
            budget = budget.parent
        budget = self
        while budget is not None:
            budget.held += nbytes
            budget = budget.parent

    def release(self, nbytes: int) -> None:
        budget: BufferBudget | None = self
        while budget is not None:
            budget.held -= nbytes
            budget = budget.parent


class BufferHold:
    """What one decoder holds against a budget; releasing it is idempotent.

    Kept apart from the decoder so that a finalizer can release it without
    keeping the decoder alive.
    """

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: BufferBudget) -> None:
        self.budget = budget
        self.nbytes = 0

    def reserve(self, nbytes: int) -> None:
        self.budget.reserve(nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        if self.nbytes:
            self.budget.release(self.nbytes)
            self.nbytes = 0


__all__ = ["BufferBudget", "BufferHold", "BufferScope"]
