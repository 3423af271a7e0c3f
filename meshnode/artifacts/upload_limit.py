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

# What one process uploads per second, while its shard holds sessions, unless configured
# otherwise. aioquic is pure Python: the serving node's event loop spends about 6% of a core
# per MiB/s sent, and that loop shares the GIL and the cores with the engine's threads, which
# take every core by default. bench/transfer.py on a quiet 2-core VM (bench/RESULTS.md,
# "Transfer (issue 16)") slowed a decoding peer by 14-17% at 1 MiB/s and by 7% at 0.5 MiB/s:
# the default is the rate inside the <= 10% the issue allows. A joiner fetching from several
# peers gets this from each, and ``is_busy`` lifts the limit while the peer serves no session.
DEFAULT_UPLOAD_BYTES_PER_S = 512 * 1024
# One upload chunk (server.UPLOAD_CHUNK_BYTES): chunks go out evenly spaced, never in a burst
# that would keep the event loop (and the GIL) from the engine thread for long.
DEFAULT_BURST_BYTES = 64 * 1024


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
    """The bucket, shared by every upload stream of the process.

    With ``is_busy`` (say, "the engine has sessions"), uploads are paced only while it is
    true: a peer that serves no one can give a joiner its full speed.
    """

    def __init__(
        self,
        bytes_per_s: float = DEFAULT_UPLOAD_BYTES_PER_S,
        burst_bytes: float = DEFAULT_BURST_BYTES,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        *,
        is_busy: Callable[[], bool] | None = None,
    ) -> None:
        self._clock_ns = clock_ns
        self._is_busy = is_busy
        self.bucket = ByteBucket.full(bytes_per_s, burst_bytes, clock_ns())

    @property
    def bytes_per_s(self) -> float:
        return self.bucket.rate

    @property
    def pacing(self) -> bool:
        """Whether uploads are paced now (always, without ``is_busy``)."""
        return self._is_busy is None or self._is_busy()

    def delay_ns(self, nbytes: int) -> int:
        """Charge ``nbytes``; nanoseconds to wait before sending them."""
        now_ns = self._clock_ns()
        if self._is_busy is not None and not self._is_busy():
            # Idle: the bytes pass unpaced, and the bucket starts from full when work comes.
            self.bucket.tokens, self.bucket.updated_ns = self.bucket.burst, now_ns
            return 0
        return self.bucket.charge(nbytes, now_ns)

    async def acquire(self, nbytes: int) -> None:
        delay_ns = self.delay_ns(nbytes)
        if delay_ns:
            await asyncio.sleep(delay_ns / SECOND_NS)


__all__ = ["DEFAULT_BURST_BYTES", "DEFAULT_UPLOAD_BYTES_PER_S", "ByteBucket", "UploadLimiter"]
