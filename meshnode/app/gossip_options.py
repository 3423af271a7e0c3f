"""The command-line options of how a node gossips membership (:mod:`meshnode.node.delta_gossip`).

``--gossip full`` (the default) is the gossip small meshes have always had: each heartbeat a node
exchanges its whole table with every peer it knows, and keeps a link to each. ``--gossip delta``
is for meshes of hundreds or thousands of members: each heartbeat a node exchanges a digest with
``--gossip-fanout`` peers of an active view of at most ``--active-view``, then only the records
that differ, and finds dead members by SWIM probes instead of by every record's heartbeat. All
members of a mesh should run the same mode: a full-gossip member still admits a delta one, but it
keeps exchanging whole tables with it.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshnode.commandline.argument_types import positive_int
from meshnode.node.config import NodeConfig

_DEFAULTS = NodeConfig()
_DEFAULT_MAX_PEERS = _DEFAULTS.max_peers


def add_gossip_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--gossip",
        choices=("full", "delta"),
        default="full",
        help="full: each heartbeat exchange the whole table with every peer (a few dozen members); "
        "delta: a digest with a few peers of a bounded view, then only what differs, and SWIM "
        "probes for liveness (hundreds to thousands of members; every member should use it) "
        "(default full)",
    )
    group.add_argument(
        "--gossip-fanout",
        type=positive_int,
        default=_DEFAULTS.gossip_fanout,
        metavar="N",
        help=f"--gossip delta: peers to exchange digests with each heartbeat ({_DEFAULTS.gossip_fanout})",
    )
    group.add_argument(
        "--active-view",
        type=positive_int,
        default=_DEFAULTS.active_view,
        metavar="N",
        help=f"--gossip delta: most peers kept linked for gossip ({_DEFAULTS.active_view})",
    )

    group.add_argument(
        "--max-peers",
        type=positive_int,
        default=_DEFAULT_MAX_PEERS,
        metavar="N",
        help=f"most members this node's peer table holds; a new member beyond it is refused "
        f"({_DEFAULT_MAX_PEERS}: twice the 1,024 members the mesh is measured at)",
    )


def gossip_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The NodeConfig fields the options set."""
    return {
        "delta_gossip": args.gossip == "delta",
        "gossip_fanout": args.gossip_fanout,
        "active_view": args.active_view,
        "max_peers": args.max_peers,
    }


__all__ = ["add_gossip_options", "gossip_settings"]
