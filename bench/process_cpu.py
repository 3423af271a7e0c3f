"""CPU time of processes and of their threads, from Linux ``/proc``, for benchmarks that ask where
a machine's cores went.

A meshnode process runs its event loop on the main thread (thread id = process id); everything
else it burns is the engine: the engine thread (which is also the master of llama.cpp's OpenMP
team while it computes), the team's workers and the executors. So ``CpuSplit`` is the loop's
share and the rest. A thread that ends between two readings takes its time with it, which only
undercounts; the nodes' threads live as long as the node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU time of each live thread of a process so far, by thread id."""
    times: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = _stat_cpu_seconds((task / "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended while listed
            continue
    return times


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds of a process over an interval: its main thread's and the other threads'."""

    main_s: float
    others_s: float

    @property
    def total_s(self) -> float:
        return self.main_s + self.others_s


def cpu_split_since(pid: int, before: Mapping[int, float]) -> CpuSplit:
    """What each thread of ``pid`` used since ``before`` (a ``thread_cpu_seconds`` reading),
    split into the main thread and the rest; threads born since count from zero."""
    main = others = 0.0
    for tid, seconds in thread_cpu_seconds(pid).items():
        used = seconds - before.get(tid, 0.0)
        if tid == pid:
            main += used
        else:
            others += used
    return CpuSplit(main, others)


def usable_cores() -> int:
    """The cores this process (and the nodes it starts) may run on."""
    return len(os.sched_getaffinity(0))


__all__ = ["CpuSplit", "cpu_seconds", "cpu_split_since", "thread_cpu_seconds", "usable_cores"]
