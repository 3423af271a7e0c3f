"""Whether a route's stages are kept busy at once (``SessionRoute.pipeline_stages``).

A worker that is told a route has S stages runs its sessions in cohorts of at most
floor(sessions / S) a batch, one at least (meshnode.dataplane.cohorts), so that with S or more
generations every stage computes while the others do. That pays where each stage has cores of
its own; where stages share cores the convoy of one batch is cheaper (each stage reads its
weights once for every session). ``auto`` tells them apart by what the hops announce: every hop
names the host it listens on, and hops that name the same host all say how many threads they
compute with and which CPUs they may run on, and those CPUs number at least their threads and
an event loop each (a record that overstates them changes how sessions are batched, never what
they compute: each session's text is the one it gets alone either way). A head may
ask for fewer cohorts than stages (``cohorts``; two by default, meshnode.head.driver), which
keeps the batches of a stage that costs most larger. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshnode.dataplane.route_limits import MAX_ROUTE_HOPS

if TYPE_CHECKING:
    from meshnode.head.planner import Hop

PIPELINE_MODES = ("auto", "on", "off")
MAX_PIPELINE_COHORTS = MAX_ROUTE_HOPS + 1  # a route's stages at most


def pipeline_stages(mode: str, hops: Sequence[Hop], cohorts: int = 0) -> int:
    """The ``pipeline_stages`` a route of ``hops`` is opened with under ``mode``; 0 for none.

    ``cohorts`` (2 or more; 0: one per stage) keeps fewer stages busy than the route has, in
    cohorts of larger batches: where one stage costs most (a tail over a large vocabulary)
    and its cost per token falls with the batch, two cohorts keep it computing while the
    other stages prepare the next, without splitting its batch three ways."""
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline mode must be one of {', '.join(PIPELINE_MODES)}, not {mode!r}")
    if mode == "off" or len(hops) < 2:
        return 0
    if mode == "auto" and not _cores_of_their_own(hops):
        return 0
    return min(cohorts, len(hops)) if cohorts else len(hops)


def _cores_of_their_own(hops: Sequence[Hop]) -> bool:
    """Whether every hop computes on cores no other hop of the route computes on: each names
    where it runs, and every machine they share has cores for all of its hops."""
    return all(hop.hosts for hop in hops) and all(map(_has_cores_for, _machines(hops)))


def _machines(hops: Sequence[Hop]) -> list[list[Hop]]:
    """The hops grouped by machine: hops naming a common host share one."""
    machines: list[tuple[set[str], list[Hop]]] = []
    for hop in hops:
        hosts, members = set(hop.hosts), [hop]
        apart = []
        for machine_hosts, machine_hops in machines:
            if machine_hosts & hop.hosts:
                hosts |= machine_hosts
                members += machine_hops
            else:
                apart.append((machine_hosts, machine_hops))
        machines = [*apart, (hosts, members)]
    return [members for _, members in machines]


def _has_cores_for(machine: list[Hop]) -> bool:
    """Whether the hops of one machine compute on cores of their own: a hop alone always does;
    several do where every one says its threads and CPUs, and the CPUs they may use number at
    least their threads and an event loop each."""
    if len(machine) == 1:
        return True
    if any(hop.compute_threads < 1 or not hop.cpus for hop in machine):
        return False
    cpus = frozenset().union(*(hop.cpus for hop in machine))
    return len(cpus) >= sum(hop.compute_threads + 1 for hop in machine)


__all__ = ["MAX_PIPELINE_COHORTS", "PIPELINE_MODES", "pipeline_stages"]
