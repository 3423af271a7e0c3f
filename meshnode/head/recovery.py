"""What the head does when a generation's route fails. Pure: an error in, a decision out.

Three answers:

- ``REBUILD``: a hop lost the session's cache (``CACHE_MISS``: evicted, expired,
  restarted). Re-prefill from position 0 under the same route session and epoch
  and replay what was generated; once per epoch, because a second miss right
  after a rebuild means the route cannot hold the session.
- ``REROUTE``: a hop died, timed out, refused or broke the protocol. The edge
  finds the hops that are gone (probing each), excludes them, plans a new route
  at epoch + 1 and replays the session's tokens on it. Bounded per generation;
  when no hop is found dead, the head first waits a little (``settle_delay_s``).
- ``GIVE_UP``: the request itself cannot be served (it does not fit a session's
  context), or the budget of reroutes is spent. No route at all is decided by
  the planner, not here.

Cancellation is not a failure: the caller checks for its own cancel before asking.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from meshnode.wire.errors import MeshnodeError, ShardProtocolError
from meshnode.wire.pb import shard


class Recovery(Enum):
    REBUILD = "rebuild"
    REROUTE = "reroute"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class Decision:
    recovery: Recovery
    # One line for logs and, on GIVE_UP, for the client.
    reason: str
    # GIVE_UP because of the request itself (it cannot fit), not because the route failed.
    request_too_large: bool = False


@dataclass(frozen=True)
class RecoveryBudget:
    rebuilds_per_epoch: int = 1
    reroutes: int = 4
    # A failed route whose hops all still answer is planned again much as it was; what broke it
    # is often passing (a hop that has not yet heard the next hop's address through gossip, a
    # dial tie-break between two hops), so the head waits before it, doubling up to the cap.
    settle_s: float = 0.2
    max_settle_s: float = 1.6


def describe(error: BaseException) -> str:
    if isinstance(error, ShardProtocolError):
        return f"{error.code_name.removeprefix('ERROR_CODE_').lower()}: {error.detail}"
    return str(error) or type(error).__name__


# Errors a route can cause (and a new route may cure); anything else is a bug and surfaces as such.
ROUTE_FAILURES: tuple[type[BaseException], ...] = (MeshnodeError, ConnectionError, TimeoutError)


class RecoveryPolicy:
    """Decides, and counts what it decided, for one generation."""

    def __init__(self, budget: RecoveryBudget | None = None) -> None:
        self.budget = budget or RecoveryBudget()
        self.rebuilds_this_epoch = 0
        self.reroutes = 0

    def decide(self, error: BaseException) -> Decision:
        reason = describe(error)
        if isinstance(error, ShardProtocolError):
            if error.code == shard.ERROR_CODE_RESOURCE_EXHAUSTED and not error.retryable:
                # It can never fit unchanged: a prompt plus max_tokens beyond a session's context.
                return Decision(
                    Recovery.GIVE_UP,
                    f"the prompt does not fit the model's context on this route ({reason})",
                    request_too_large=True,
                )
            if error.code == shard.ERROR_CODE_CACHE_MISS and (
                self.rebuilds_this_epoch < self.budget.rebuilds_per_epoch
            ):
                self.rebuilds_this_epoch += 1
                return Decision(Recovery.REBUILD, reason)
        if self.reroutes >= self.budget.reroutes:
            return Decision(
                Recovery.GIVE_UP, f"the route failed {self.reroutes + 1} times; last failure: {reason}"
            )
        self.reroutes += 1
        self.rebuilds_this_epoch = 0
        return Decision(Recovery.REROUTE, reason)

    def settle_delay_s(self) -> float:
        """How long to wait before the reroute just decided when no hop of the route was found dead."""
        doublings = max(0, self.reroutes - 1)
        return min(self.budget.max_settle_s, self.budget.settle_s * 2**doublings)


__all__ = ["ROUTE_FAILURES", "Decision", "Recovery", "RecoveryBudget", "RecoveryPolicy", "describe"]
