"""How many sessions one batch may take so that every stage of a pipeline has work.

Continuous batching with the arrival forecast (meshnode.dataplane.arrival_forecast) gathers
every session a shard serves into one batch, and the sessions then travel the route as one
convoy: while it computes at one stage the others wait for it. Where the stages share one
machine's cores that is the cheapest way (each stage reads its weights once for all of
them). Where they are machines of their own it leaves S - 1 of S stages idle at any moment
(measured with stages that take fixed times, bench/pipeline_overlap.py). A head that wants
its stages busy at once says how many (``SessionRoute.pipeline_stages``: the route's stages,
or fewer where the head asks for fewer, larger cohorts); a worker then runs those sessions at
most floor(sessions / stages) a batch (one at least), so that there are at least as many
cohorts as the head asked for, and the scheduler's round robin sends each cohort on while the next one
computes here; the free engine no longer waits for sessions due back, which would gather the
cohorts into one convoy again. Where one stage costs most, sessions gather there while it
computes, up to the cohort's size: with two cohorts that stage keeps batches of two, with one
per stage it computes them one at a time (bench/RESULTS.md). (Rounding up instead left four
sessions on three equal stages in two cohorts, one stage always idle: 87 against 120 tokens/s
in bench/pipeline_overlap.py; waiting for sessions due back held six sessions to 102 tokens/s
against 124-139 without, and waiting only until a cohort was full cost equal stages 141
against 160 tokens/s at eight sessions and gained a tail-heavy route nothing.)

Pure arithmetic over the sessions a worker holds; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable


def cohort_limit(pipeline_stages: Iterable[int]) -> int | None:
    """The most units one batch takes, given each held session's ``pipeline_stages``; None when
    no session asks for cohorts (0 or 1: the convoy). Every session held counts, shared out
    over the most stages any route has: a session that did not ask still takes a place in
    some cohort, and on routes of fewer stages the cohorts are smaller, every stage fed."""
    stages = list(pipeline_stages)
    most = max(stages, default=0)
    if most < 2:
        return None
    return max(1, len(stages) // most)


__all__ = ["cohort_limit"]
