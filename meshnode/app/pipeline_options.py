"""``--pipeline auto|on|off``: whether a route's stages compute different generations at once.

With it on, a head opens its routes with their stage count and every worker runs the
sessions of such routes in cohorts (meshnode.dataplane.cohorts), so that with as many
concurrent generations as stages every stage has work. ``auto`` turns it on for a route whose
hops each announce a host of their own (machines of their own), and off where two share one.
``off`` is the default: stages that batch (a real model's do) lose more by running fewer
sessions a batch than they gain by overlapping; measured on real nodes each on cores of their
own, 48.7 tokens/s in cohorts against 59.3 as one convoy (bench/RESULTS.md). Stages whose cost
hardly falls with the batch (bench/pipeline_overlap.py) gain from ``on``.
Like every option it may come from the environment (``MESHNODE_PIPELINE``) or the config file.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.head.pipeline import PIPELINE_MODES


def add_pipeline_options(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--pipeline",
        choices=PIPELINE_MODES,
        default="off",
        help="keep a route's stages busy with different generations at once by running sessions "
        "in cohorts: where every hop is on a machine of its own (auto), always (on), or never "
        "(off, the default: every session in one batch, which measured faster on real models "
        "because a stage's cost per token falls with its batch)",
    )


__all__ = ["add_pipeline_options"]
