"""Token buckets, time as a parameter (monotonic nanoseconds, :mod:`meshnode.sansio`).

The relay charges every frame a client sends against two buckets (bytes and
frames) and stops reading from a client whose buckets are in debt until they
refill: the client is slowed, never dropped. The node's relay client runs the
same buckets against the limits the relay announced, so it paces itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshnode.sansio import SECOND_NS


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; a rate of 0 means unlimited.

    Delays are returned in nanoseconds, rounded up, so waiting them out always suffices.
    """

    rate: float
    burst: float
    tokens: float
    updated_ns: int

    @classmethod
    def full(cls, rate: float, burst: float, now_ns: int) -> TokenBucket:
        if rate < 0 or burst < 0:
            raise ValueError("token bucket rate and burst must not be negative")
        return cls(rate=rate, burst=burst, tokens=burst, updated_ns=now_ns)

    @property
    def unlimited(self) -> bool:
        return self.rate == 0

    def _refill(self, now_ns: int) -> None:
        if now_ns > self.updated_ns:
            elapsed_s = (now_ns - self.updated_ns) / SECOND_NS
            self.tokens = min(self.burst, self.tokens + elapsed_s * self.rate)
            self.updated_ns = now_ns

    def charge(self, amount: float, now_ns: int) -> int:
        """Take ``amount`` (the balance may go negative); nanoseconds until it is back to zero."""
        if self.unlimited:
            return 0
        self._refill(now_ns)
        self.tokens -= amount
        return self.debt_delay_ns(now_ns)

    def debt_delay_ns(self, now_ns: int) -> int:
        """Nanoseconds until the balance is no longer negative."""
        if self.unlimited:
            return 0
        self._refill(now_ns)
        return 0 if self.tokens >= 0 else _ns(-self.tokens / self.rate)

    def delay_for_ns(self, amount: float, now_ns: int) -> int:
        """Nanoseconds until ``amount`` tokens are available (for a client pacing itself)."""
        if self.unlimited:
            return 0
        self._refill(now_ns)
        # A request above the burst can never be satisfied in full; wait for a full bucket.
        need = min(amount, self.burst)
        return 0 if self.tokens >= need else _ns((need - self.tokens) / self.rate)


def _ns(seconds: float) -> int:
    return math.ceil(seconds * SECOND_NS)


__all__ = ["TokenBucket"]
