"""The command-line options of direct paths behind NAT (:mod:`meshnode.traversal`) for the node commands.

``--hole-punching on`` (the default) lets two members behind NAT replace the relay between them
with a direct QUIC path: the relay only introduces them, over their sealed relayed link. ``off``
keeps every hop to a peer behind NAT on the relay (a peer on the same LAN is still dialled at its
private address; ``--relay-only`` dials nothing directly at all).
"""

from __future__ import annotations

import argparse
import dataclasses

from meshnode.commandline.argument_types import positive
from meshnode.traversal.config import TraversalConfig
from meshnode.traversal.pair_backoff import PunchSchedule

_DEFAULTS = TraversalConfig()


def add_traversal_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--hole-punching",
        choices=("on", "off"),
        default="on",
        help="punch a direct path to peers behind NAT through the relay, and keep using the relay "
        "only where the NATs do not allow one (default on; `meshnode status` shows each peer's path)",
    )
    # Hidden: how long a pair that failed to punch waits before its next round; tests shorten it.
    group.add_argument(
        "--punch-backoff",
        type=positive,
        default=_DEFAULTS.schedule.first_backoff_s,
        help=argparse.SUPPRESS,
    )


def traversal_settings(args: argparse.Namespace) -> TraversalConfig:
    schedule: PunchSchedule = dataclasses.replace(_DEFAULTS.schedule, first_backoff_s=args.punch_backoff)
    return dataclasses.replace(_DEFAULTS, hole_punching=args.hole_punching == "on", schedule=schedule)


__all__ = ["add_traversal_options", "traversal_settings"]
