"""The upload budget every artifact upload of a process shares: a token bucket in bytes.

Uploading costs a serving peer CPU (QUIC in Python, hashing nothing but still copying)
that its own decode would otherwise use, so uploads are paced to a rate that leaves
decode latency where it was (bench/transfer.py measures it). The bucket is pure, with
time as a parameter; :class:`UploadLimiter` only sleeps out its delays.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshnode.sansio import SECOND_NS

# What one process uploads per second unless configured otherwise. aioquic is pure Python:
# sending costs about a core per 12 MB/s, taken from the serving peer's decode. At this rate a
# peer decoding Gemma 3 270M on 2 cores slowed by under 10% (bench/RESULTS.md, "Transfer
# (issue 16)"); at 4 MiB/s it slowed by half. A joiner fetching from several peers gets this
# from each.
DEFAULT_UPLOAD_BYTES_PER_S = 2 * 1024 * 1024
# Enough for a couple of chunks at once, so pacing is smooth but a burst stays small.
DEFAULT_BURST_BYTES = 512 * 1024


@dataclass
class ByteBucket:
    """``rate`` bytes per second up to ``burst``; rate 0 means unlimited."""

    rate: float
    burst: float
    tokens: float
    updated_ns: int

    @classmethod
    def full(cls, rate: float, burst: float, now_ns: int) -> ByteBucket:
        if rate < 0 or burst <= 0:
            raise ValueError("an upload rate must not be negative and its burst must be positive")
        return cls(rate, burst, burst, now_ns)

    def charge(self, nbytes: int, now_ns: int) -> int:
        """Take ``nbytes`` (the balance may go negative); nanoseconds to wait before sending them."""
        if self.rate == 0:
            return 0
        if now_ns > self.updated_ns:
            self.tokens = min(self.burst, self.tokens + (now_ns - self.updated_ns) * self.rate / SECOND_NS)
            self.updated_ns = now_ns
        self.tokens -= nbytes
        return 0 if self.tokens >= 0 else math.ceil(-self.tokens / self.rate * SECOND_NS)


class UploadLimiter:
    """The bucket, shared by every upload stream of the process."""

    def __init__(
        self,
        bytes_per_s: float = DEFAULT_UPLOAD_BYTES_PER_S,
        burst_bytes: float = DEFAULT_BURST_BYTES,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._clock_ns = clock_ns
        self.bucket = ByteBucket.full(bytes_per_s, burst_bytes, clock_ns())

    @property
    def bytes_per_s(self) -> float:
        return self.bucket.rate

    async def acquire(self, nbytes: int) -> None:
        delay_ns = self.bucket.charge(nbytes, self._clock_ns())
        if delay_ns:
            await asyncio.sleep(delay_ns / SECOND_NS)


__all__ = ["DEFAULT_BURST_BYTES", "DEFAULT_UPLOAD_BYTES_PER_S", "ByteBucket", "UploadLimiter"]
