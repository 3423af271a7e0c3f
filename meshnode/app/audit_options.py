"""``--audit-rate R``: the share of a head's finished generations audited by replica (issue 56).

Written as a fraction (``0.02``) or a percentage (``2%``); 0 turns audits off. A generation
whose route has no replica of any of its ranges is never audited, whatever the rate
(meshnode.head.auditor).
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.head.driver_config import DriverConfig


def parse_audit_rate(text: str) -> float:
    percent = text.strip().endswith("%")
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate such as 0.02 or 2%, got {text!r}") from None
    if percent:
        value /= 100
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("the audit rate is between 0 and 1 (0% and 100%)")
    return value


def add_audit_options(parser: argparse.ArgumentParser | Any) -> None:
    default = DriverConfig().audit_rate
    parser.add_argument(
        "--audit-rate",
        type=parse_audit_rate,
        default=default,
        metavar="R",
        help="share of finished generations recomputed on other replicas of their ranges and "
        "compared hop by hop, a node that computed wrong convicted with signed evidence "
        f"(default {default * 100:g}%%, written 0.02 or 2%%; 0 turns audits off; routes without a replica "
        "are never audited)",
    )


__all__ = ["add_audit_options", "parse_audit_rate"]
