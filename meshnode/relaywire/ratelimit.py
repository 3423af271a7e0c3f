"""Token buckets, time as a parameter.

The relay charges every frame a client sends against two buckets (bytes and
frames) and stops reading from a client whose buckets are in debt until they
refill: the client is slowed, never dropped. The node's relay client runs the
same buckets against the limits the relay announced, so it paces itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; a rate of 0 means unlimited."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        if rate < 0 or burst < 0:
            raise ValueError("token bucket rate and burst must not be negative")
        return cls(rate=rate, burst=burst, tokens=burst, updated=now)

    @property
    def unlimited(self) -> bool:
        return self.rate == 0

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def charge(self, amount: float, now: float) -> float:
        """Take ``amount`` (the balance may go negative); seconds until it is back to zero."""
        if self.unlimited:
            return 0.0
        self._refill(now)
        self.tokens -= amount
        return self.debt_delay(now)

    def debt_delay(self, now: float) -> float:
        """Seconds until the balance is no longer negative."""
        if self.unlimited:
            return 0.0
        self._refill(now)
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def delay_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` tokens are available (for a client pacing itself)."""
        if self.unlimited:
            return 0.0
        self._refill(now)
        # A request above the burst can never be satisfied in full; wait for a full bucket.
        need = min(amount, self.burst)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate


__all__ = ["TokenBucket"]
