"""``--pipeline auto|on|off``: whether a route's stages compute different generations at once.

With it on, a head opens its routes with their stage count and every worker runs the
sessions of such routes in cohorts (meshnode.dataplane.cohorts), so that with as many
concurrent generations as stages every stage has work. ``auto`` (the default) turns it on
for a route whose hops each announce a host of their own (machines of their own), and off
where two share one (their cores are shared, and one batch of every session is cheaper).
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
        default="auto",
        help="keep a route's stages busy with different generations at once by running sessions "
        "in cohorts: where every hop is on a machine of its own (auto, the default), always (on), "
        "or never: every session in one batch, the cheaper way on one machine's cores (off)",
    )


__all__ = ["add_pipeline_options"]
