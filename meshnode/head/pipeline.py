"""Whether a route's stages are kept busy at once (``SessionRoute.pipeline_stages``).

A worker that is told a route has S stages runs its sessions in cohorts of at most
floor(sessions / S) a batch, one at least (meshnode.dataplane.cohorts), so that with S or more
generations every stage computes while the others do. That pays where each stage has a
machine of its own; where stages share one machine's cores the convoy of one batch is cheaper
(each stage reads its weights once for every session). ``auto`` tells them apart by what the
hops announce: every hop names the host it listens on and no two name the same one. A head may
ask for fewer cohorts than stages (``cohorts``; two by default, meshnode.head.driver), which
keeps the batches of a stage that costs most larger. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.dataplane.route import MAX_ROUTE_HOPS
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
    if mode == "auto":
        seen: set[str] = set()
        for hop in hops:
            if not hop.hosts or hop.hosts & seen:
                return 0  # a hop says nothing of where it runs, or shares a machine with another
            seen |= hop.hosts
    return min(cohorts, len(hops)) if cohorts else len(hops)


__all__ = ["MAX_PIPELINE_COHORTS", "PIPELINE_MODES", "pipeline_stages"]
