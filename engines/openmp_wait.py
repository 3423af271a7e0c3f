"""How long llama.cpp's OpenMP threads should spin when they wait, for processes on one machine.

After every graph, and at every barrier inside one, libgomp's threads spin before they sleep
(300 000 spins by default). A process with the cores to itself gains by it: its threads catch
the next graph and the next barrier hot instead of through a futex wake-up (one meshnode node on
this project's 2-core VM: 37 tokens/s spinning against 32 with a short spin, bench/RESULTS.md).
Several processes sharing too few cores lose by it: each one's spinning threads take the cores
the others need (three nodes on two cores decoded 9-17 tokens/s spinning), so there a short
spin (``SHORT_SPIN_ENV``) keeps the barriers cheap and lets idle processes sleep. Not sleeping at
once (``OMP_WAIT_POLICY=PASSIVE``): that makes every barrier inside a graph a futex wake-up, and
a node twice as slow.

libgomp reads the setting once, when llama.cpp's library loads: it belongs in the environment a
process starts with, not in one it changes afterwards.
"""

from __future__ import annotations

import os

SHORT_SPIN_ENV: dict[str, str] = {"GOMP_SPINCOUNT": "1000"}


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def processes_share_cores(processes: int, threads: int | None, cpus: int, *, others: int = 0) -> bool:
    """Whether ``processes`` llama.cpp processes of ``threads`` compute threads each (None: all
    the cores, llama.cpp's default) and an event loop each, beside ``others`` busy threads of
    other programs, need more than ``cpus`` cores. One process alone never does: its own spinning
    threads take no core another llama.cpp process needs."""
    if processes <= 1:
        return False
    if threads is None:
        return True
    return cpus < processes * (threads + 1) + others


def openmp_wait_env(processes: int, threads: int | None, cpus: int, *, others: int = 0) -> dict[str, str]:
    """The environment that suits ``processes`` such processes on ``cpus`` cores: the short spin
    where they share cores, nothing (libgomp's own spin) where each has cores of its own."""
    shared = processes_share_cores(processes, threads, cpus, others=others)
    return dict(SHORT_SPIN_ENV) if shared else {}


__all__ = ["SHORT_SPIN_ENV", "available_cpus", "openmp_wait_env", "processes_share_cores"]
