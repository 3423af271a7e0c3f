"""``--max-sessions N|auto`` and ``--kv-budget SIZE|auto``: how many sessions a shard holds at once.

The count is fixed when the engine loads (llama.cpp allocates every session's
KV cache then) and is announced as the node's capacity. Auto sizes it with
:mod:`meshnode.dataplane.kv_budget`: as many caches of ``--ctx`` tokens over
the served layers as the budget holds. Like every option these come from the
command line, ``MESHNODE_MAX_SESSIONS`` / ``MESHNODE_KV_BUDGET`` or the config
file (``max-sessions = 8``, ``kv-budget = "2G"``).
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from meshnode.dataplane.kv_budget import (
    AUTO_SESSIONS_CAP,
    LLAMA_MAX_SEQ,
    KvShapeError,
    plan_sessions,
    shard_session_plan,
)

log = logging.getLogger(__name__)

AUTO = "auto"
# What a shard holds when its KV size cannot be read from the file: the count before auto existed.
FALLBACK_SESSIONS = 4
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$")
_SCALE = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_max_sessions(text: str) -> int | None:
    """``auto`` (None) or a count from 1 to llama.cpp's limit."""
    if text.strip().lower() == AUTO:
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of sessions or 'auto', got {text!r}") from None
    if not 1 <= value <= LLAMA_MAX_SEQ:
        raise argparse.ArgumentTypeError(f"sessions must be between 1 and {LLAMA_MAX_SEQ}")
    return value


def parse_size(text: str) -> int | None:
    """``auto`` (None), or bytes: ``1073741824``, ``512M``, ``2G``, ``1.5GiB`` (powers of 1024)."""
    lowered = text.strip().lower()
    if lowered == AUTO:
        return None
    found = _SIZE.match(lowered)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M, 2G or 'auto')")
    value = int(float(found.group(1)) * _SCALE[found.group(2)])
    if value <= 0:
        raise argparse.ArgumentTypeError("a size must be positive")
    return value


def add_session_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--max-sessions",
        type=parse_max_sessions,
        default=None,
        metavar="N|auto",
        help=f"sessions this shard holds at once (1 to {LLAMA_MAX_SEQ}); auto (the default): as many "
        f"KV caches of --ctx tokens as --kv-budget holds, at most {AUTO_SESSIONS_CAP}",
    )
    parser.add_argument(
        "--kv-budget",
        type=parse_size,
        default=None,
        metavar="SIZE|auto",
        help="memory the shard's KV caches may use with --max-sessions auto, e.g. 2G; auto (the "
        "default): half the memory available once the weights are loaded, at most 1 GiB",
    )


def max_sessions(args: argparse.Namespace, model: Path, layers: tuple[int, int] | None, ctx: int) -> int:
    """The sessions a shard of ``model`` holds under ``--max-sessions`` and ``--kv-budget``, logged
    with how it was found."""
    chosen = getattr(args, "max_sessions", None)
    budget = getattr(args, "kv_budget", None)
    try:
        plan = shard_session_plan(model, layers, ctx, chosen=chosen, budget_bytes=budget)
    except (KvShapeError, OSError) as exc:
        # The engine's load refuses a file it cannot use with the real reason; this only sizes it.
        plan = plan_sessions(0, chosen=chosen, fallback=FALLBACK_SESSIONS)
        log.warning("cannot size the KV cache of %s (%s); %d sessions", model.name, exc, plan.sessions)
        return plan.sessions
    log.info("%s holds %s", model.name, plan.describe())
    return plan.sessions


__all__ = ["add_session_options", "max_sessions", "parse_max_sessions", "parse_size"]
