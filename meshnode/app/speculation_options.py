"""``--speculation off|auto`` and ``--draft-max K``: speculative decoding at the head (issue 20).

``auto`` (the default) drafts tokens by prompt lookup for greedy and seeded sampled requests
and verifies up to ``--draft-max`` of them a round trip (meshnode.head.speculation); penalised
and grammar requests decode a token at a time whatever this says. ``off`` decodes a token at a time always.
Like every option they may come from the environment (``MESHNODE_SPECULATION``) or the config
file (``speculation = "off"``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from engines.request_limits import MAX_DRAFT_TOKENS
from meshnode.app.prefix_cache_options import answer_keeping_on, prefix_cache_on
from meshnode.head.driver_config import DriverConfig

SPECULATION_CHOICES = ("auto", "off")


def parse_draft_max(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens, got {text!r}") from None
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"draft tokens must be between 1 and {MAX_DRAFT_TOKENS}")
    return value


def add_speculation_options(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--speculation",
        choices=SPECULATION_CHOICES,
        default="auto",
        help="speculative decoding of greedy and sampled requests (not penalised or grammar ones): "
        "draft tokens by prompt lookup and verify them over the route in one round trip, the text "
        "unchanged (auto, the default), or one token a round trip (off)",
    )
    parser.add_argument(
        "--draft-max",
        type=parse_draft_max,
        default=DriverConfig().draft_max,
        metavar="K",
        help=f"draft tokens verified per round trip at most (1 to {MAX_DRAFT_TOKENS}, default "
        f"{DriverConfig().draft_max})",
    )


def driver_config(args: argparse.Namespace, base: DriverConfig | None = None) -> DriverConfig:
    """``base`` (the defaults) with the speculation (and the ``--pipeline``,
    meshnode.app.pipeline_options, and ``--prefix-cache``, meshnode.app.prefix_cache_options)
    the command line asked for, and ``--audit-rate`` (meshnode.app.audit_options)."""
    base = base or DriverConfig()
    speculation = getattr(args, "speculation", "auto") != "off"
    return replace(
        base,
        speculation=speculation,
        draft_max=getattr(args, "draft_max", base.draft_max),
        pipeline=getattr(args, "pipeline", base.pipeline),
        pipeline_cohorts=getattr(args, "pipeline_cohorts", base.pipeline_cohorts),
        prefix_cache=base.prefix_cache and prefix_cache_on(args),
        keep_answers=base.keep_answers and answer_keeping_on(args),
        audit_rate=getattr(args, "audit_rate", base.audit_rate),
    )


__all__ = ["SPECULATION_CHOICES", "add_speculation_options", "driver_config", "parse_draft_max"]
