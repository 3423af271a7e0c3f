"""CPU time of processes and of their threads, from Linux ``/proc``, for benchmarks that ask where
a machine's cores went.

A meshnode process runs its event loop on the main thread (thread id = process id); everything
else it burns is the engine: the engine thread (which is also the master of llama.cpp's OpenMP
team while it computes), the team's workers and the executors. So ``CpuSplit`` is the loop's
share and the rest. The rest is the process's total less the loop's, so threads that end between
two readings still count (a llama.cpp built without OpenMP starts and joins its compute threads
for every graph).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_cpu_seconds(stat_text: str) -> float:
    # utime and stime are fields 14 and 15 of stat(5); the name before ")" may hold spaces.
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads, ended ones included."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU seconds so far: all its threads, ended ones included, and its main thread's."""

    total_s: float
    main_s: float


def cpu_reading(pid: int) -> CpuReading:
    main = _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat").read_text())
    return CpuReading(total_s=cpu_seconds(pid), main_s=main)


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds of a process over an interval: its main thread's and the other threads'."""

    main_s: float
    others_s: float

    @property
    def total_s(self) -> float:
        return self.main_s + self.others_s


def cpu_split_since(pid: int, before: CpuReading) -> CpuSplit:
    """What ``pid`` used since ``before`` (a ``cpu_reading``), split into the main thread and the rest."""
    now = cpu_reading(pid)
    main = now.main_s - before.main_s
    return CpuSplit(main, now.total_s - before.total_s - main)


__all__ = ["CpuReading", "CpuSplit", "cpu_reading", "cpu_seconds", "cpu_split_since"]
