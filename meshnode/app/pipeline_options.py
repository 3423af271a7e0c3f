"""``--pipeline auto|on|off`` and ``--pipeline-cohorts N``: whether a route's stages compute
different generations at once, and in how many cohorts.

With it on, a head opens its routes with the number of cohorts (``SessionRoute.pipeline_stages``)
and every worker runs the sessions of such routes in cohorts (meshnode.dataplane.cohorts), so
that stages compute different cohorts at once instead of passing one convoy along. ``auto`` (the
default) turns it on for a route whose hops compute on cores of their own: each on a host of its
own, or sharing one that has a CPU for every compute thread and event loop of them (they announce
their threads and CPUs); off where they would share cores (one batch of every session is cheaper
there, meshnode.head.pipeline). Two cohorts by default, not one per stage: a real model's stages batch, the tail over
a large vocabulary most, and cohorts of one per stage left it computing one session at a time
(bench/RESULTS.md). Like every option these may come from the environment (``MESHNODE_PIPELINE``,
``MESHNODE_PIPELINE_COHORTS``) or the config file.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.head.driver_config import DriverConfig
from meshnode.head.pipeline import MAX_PIPELINE_COHORTS, PIPELINE_MODES


def add_pipeline_options(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--pipeline",
        choices=PIPELINE_MODES,
        default=DriverConfig().pipeline,
        help="keep a route's stages busy with different generations at once by running sessions "
        "in cohorts: where every hop computes on cores of its own, a machine of its own or a share "
        "of one with a CPU for every thread (auto, the default), always (on), or never: every "
        "session in one batch, the cheaper way where stages share cores (off)",
    )
    parser.add_argument(
        "--pipeline-cohorts",
        type=parse_pipeline_cohorts,
        default=DriverConfig().pipeline_cohorts,
        metavar="N",
        help="how many cohorts a pipelined route's sessions are split into: 2 or more, at most one "
        f"per stage, or 0 for one per stage (default {DriverConfig().pipeline_cohorts}: larger "
        "batches where one stage, such as a tail over a large vocabulary, costs most)",
    )


def parse_pipeline_cohorts(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value != 0 and not 2 <= value <= MAX_PIPELINE_COHORTS:
        raise argparse.ArgumentTypeError(f"must be 0 (one per stage) or between 2 and {MAX_PIPELINE_COHORTS}")
    return value


__all__ = ["add_pipeline_options", "parse_pipeline_cohorts"]
