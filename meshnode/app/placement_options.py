"""The command-line options of a node that places itself (:mod:`meshnode.autoplace`).

A node started with no ``--model`` (``meshnode join --invite TOKEN`` alone) learns from
gossip what the mesh serves, takes the layer range that helps most within
``--memory-budget`` and fetches just those tensors from its peers into
``--model-store``. ``--placement off`` keeps such a node a plain member that serves no
layers. ``--place-by time`` (the default) sizes the range by how fast this node is against
the others, where speeds are known (``--speed-estimate`` states this node's before it has
measured its own); ``--place-by memory`` by memory alone. ``--claim-settle`` and ``--move-settle`` are the waits that keep two joiners
off one gap and a serving node from chasing coverage that flickers. Placing by time, a node
whose stage is found slow gives up the layers faster replicas serve (``--no-slow-yield``: it
keeps them).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from meshnode.app.session_options import parse_size
from meshnode.artifacts.upload_limit import DEFAULT_UPLOAD_BYTES_PER_S, UploadLimiter
from meshnode.autoplace.config import PLACE_BY_MEMORY, PLACE_BY_TIME, AutoPlaceConfig
from meshnode.commandline.argument_types import positive

AUTO, OFF = "auto", "off"
# Gossip rounds a claim stands before the node loads it; two rounds let a claim made at the
# same moment reach every node and come back.
_CLAIM_ROUNDS = 3
DEFAULT_MOVE_SETTLE_S = 60.0


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("placement and model transfer (a node started without --model)")
    group.add_argument(
        "--placement",
        choices=(AUTO, OFF),
        default=AUTO,
        help="auto (the default): take the layer range the mesh needs most and fetch it from peers; "
        "off: serve no layers (a member that only sends requests)",
    )
    group.add_argument(
        "--memory-budget",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most memory the weights of the layers this node takes may use, e.g. 4G (default: half "
        "the memory available: RAM, or with --n-gpu-layers the free memory of the GPUs llama.cpp "
        "sees); the KV caches come on top of it (--kv-budget)",
    )
    group.add_argument(
        "--model-store",
        type=Path,
        default=None,
        metavar="DIR",
        help="where fetched model tensors are kept and resumed from, by one node at a time "
        "(default: <data-dir>/models)",
    )
    group.add_argument(
        "--upload-limit",
        type=parse_size,
        default=DEFAULT_UPLOAD_BYTES_PER_S,
        metavar="SIZE",
        help="most bytes per second this node sends to nodes fetching model tensors from it, all "
        "together, while its shard holds sessions, so its own decode barely slows (unlimited while it "
        f"holds none; default {DEFAULT_UPLOAD_BYTES_PER_S // 1024}K)",
    )
    group.add_argument(
        "--place-by",
        choices=(PLACE_BY_TIME, PLACE_BY_MEMORY),
        default=PLACE_BY_TIME,
        help="time (the default): take the range that makes the mesh's best route fastest, a fast "
        "node more layers and a slow one fewer, where this node and the nodes on the route announce "
        "their speed (by memory where one does not), and move only for a lasting gain; memory: as "
        "many layers as --memory-budget holds, whatever the speeds",
    )
    group.add_argument(
        "--speed-estimate",
        type=positive,
        default=None,
        metavar="FACTOR",
        help="how fast this machine is against the mesh's nodes before it has served (1: as fast as "
        "the fastest node that measured its speed, 0.33: a third as fast), for --place-by time "
        "(default: measured before the first claim, by loading and timing one layer)",
    )
    group.add_argument(
        "--slow-yield",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --place-by time, when this node's stage has long been far slower than the others' "
        "for its layers, give up the layers faster nodes also serve, after --move-settle (the "
        "default); --no-slow-yield keeps them",
    )
    group.add_argument(
        "--claim-settle",
        type=positive,
        default=None,
        metavar="SECONDS",
        help=f"how long a claimed range stands before it is loaded (default {_CLAIM_ROUNDS} heartbeats)",
    )
    group.add_argument(
        "--move-settle",
        type=positive,
        default=DEFAULT_MOVE_SETTLE_S,
        metavar="SECONDS",
        help="how long another range must stay more useful before a serving node moves to it "
        f"(default {DEFAULT_MOVE_SETTLE_S:g})",
    )


def upload_limiter(args: argparse.Namespace, is_busy: Callable[[], bool]) -> UploadLimiter:
    """``--upload-limit``, applied while ``is_busy()`` (this node's shard holds sessions): an idle
    node has no decode to protect and uploads as fast as the link goes."""
    return UploadLimiter(float(args.upload_limit), is_busy=is_busy)


def placement_settings(args: argparse.Namespace, data_dir: Path) -> AutoPlaceConfig:
    interval = float(args.heartbeat_interval)
    return AutoPlaceConfig(
        store_dir=args.model_store or data_dir / "models",
        memory_budget=args.memory_budget,
        offload=args.n_gpu_layers > 0,
        poll_s=interval,
        claim_settle_s=args.claim_settle if args.claim_settle is not None else _CLAIM_ROUNDS * interval,
        move_settle_s=args.move_settle,
        place_by=args.place_by,
        speed_estimate=args.speed_estimate,
        slow_yield=args.slow_yield,
    )


__all__ = ["add_placement_options", "placement_settings", "upload_limiter"]
