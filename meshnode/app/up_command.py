"""``meshnode up``: run this data directory's node whatever state it is in, for scripts and containers.

    meshnode up [--invite TOKEN | --invite -] [node options]

A data directory that is already a mesh member is started (``start``); one that
is not joins with the invite when one is given (``join``), else creates a new mesh
(``create``). Running it again after a restart therefore always does the right
thing, where ``create`` refuses a member and ``start`` refuses a newcomer. A
stored membership wins over an invite: the invite, which may have expired since,
is not read again once the node is a member.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from meshnode.app import node_commands
from meshnode.app.stored_membership import stored_membership_expired
from meshnode.commandline.data_dirs import node_data_dir
from meshnode.membership.store import DataDir

log = logging.getLogger(__name__)


def up_action(args: argparse.Namespace) -> tuple[str, str]:
    """Which command ``up`` runs for ``args`` (``start``, ``join`` or ``create``), and why."""
    data_dir = DataDir(node_data_dir(args))
    invited = args.invite is not None or bool(os.environ.get(node_commands.INVITE_ENV))
    if data_dir.has_membership():
        if invited and stored_membership_expired(data_dir):
            return "join", "the stored membership certificate expired and an invite is given"
        return "start", "the data directory is a mesh member"
    if invited:
        return "join", "not a member yet and an invite is given"
    return "create", "not a member and no invite"


async def cmd_up(args: argparse.Namespace) -> int:
    action, reason = up_action(args)
    log.info("meshnode up: %s, so running `meshnode %s`", reason, action)
    if action == "start":
        return await node_commands.cmd_start(args)
    if action == "join":
        return await node_commands.cmd_join(args)
    return await node_commands.cmd_create(args)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    p = subparsers.add_parser(
        "up",
        parents=[common],
        help="run this node: start a member, else join with --invite, else create a mesh",
        description="Idempotent for scripts and containers: a data directory that is a mesh member is "
        "started; otherwise it joins with --invite (or $" + node_commands.INVITE_ENV + ") when one is "
        "given, and creates a new mesh when none is. Takes the node options of create, join and start.",
    )
    p.add_argument(
        "--invite",
        metavar="TOKEN",
        help=f"join with this invite if not yet a member (- reads stdin; or ${node_commands.INVITE_ENV})",
    )
    node_commands.add_node_options(p)
    p.set_defaults(handler=cmd_up)


__all__ = ["cmd_up", "register", "up_action"]
