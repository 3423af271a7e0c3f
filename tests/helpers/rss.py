"""Resident memory of another process, read from ``/proc/<pid>/status``."""

from __future__ import annotations

import asyncio
from pathlib import Path

MiB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class PeakRss:
    """Samples a process's VmRSS in the background; ``peak`` is the highest sample seen.

    Sampling (rather than one reading at the end) catches memory that is
    reserved and then released again, e.g. when a stalled stream is reset.
    """

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid = pid
        self.interval = interval
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sample()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def sample(self) -> int:
        value = rss_bytes(self.pid)
        self.peak = max(self.peak, value)
        return value

    def describe(self) -> str:
        return f"VmRSS {self.baseline / MiB:.0f} MiB before, {self.peak / MiB:.0f} MiB at peak"

    async def _sample(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)
