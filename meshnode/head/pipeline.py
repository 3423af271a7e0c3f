"""Whether a route's stages are kept busy at once (``SessionRoute.pipeline_stages``).

A worker that is told a route has S stages runs its sessions in cohorts of at most
floor(sessions / S) a batch, one at least (meshnode.dataplane.cohorts), so that with S or more
generations every stage computes while the others do. That pays where each stage has a
machine of its own and its cost hardly falls with the batch; where stages share one machine's
cores, or batch well (a real model's tail over a large vocabulary), the convoy of one batch is
cheaper, so the head's default is ``off`` (meshnode.head.driver.DriverOptions). ``auto`` tells
machines apart by what the hops announce: every hop names the host it listens on and no two
name the same one. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.head.planner import Hop

PIPELINE_MODES = ("auto", "on", "off")


def pipeline_stages(mode: str, hops: Sequence[Hop]) -> int:
    """The ``pipeline_stages`` a route of ``hops`` is opened with under ``mode``; 0 for none."""
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline mode must be one of {', '.join(PIPELINE_MODES)}, not {mode!r}")
    if mode == "off" or len(hops) < 2:
        return 0
    if mode == "on":
        return len(hops)
    seen: set[str] = set()
    for hop in hops:
        if not hop.hosts or hop.hosts & seen:
            return 0  # a hop says nothing of where it runs, or shares a machine with another
        seen |= hop.hosts
    return len(hops)


__all__ = ["PIPELINE_MODES", "pipeline_stages"]
