"""Where a command keeps its state: ``--data-dir``, else the default for a node or a relay.

A node's default is :func:`meshnode.identity.default_data_dir`
(``$MESHNODE_DATA_DIR``, else ``~/.local/share/meshnode``); a relay's is
:func:`default_relay_data_dir`, apart from the node's so that a relay on a
node's host never takes the node's key.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshnode.commandline.cli_error import CliError
from meshnode.identity import default_data_dir
from meshnode.membership.store import DataDir, StoreError

RELAY_DATA_DIR_ENV = "MESHNODE_RELAY_DATA_DIR"


def node_data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()


def locked_node_data_dir(args: argparse.Namespace) -> DataDir:
    """The node's data directory, locked against a second node on it; the caller unlocks it."""
    data_dir = DataDir(node_data_dir(args))
    try:
        data_dir.lock()
    except StoreError as exc:
        raise CliError(str(exc)) from None
    return data_dir


def default_relay_data_dir() -> Path:
    env = os.environ.get(RELAY_DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "meshnode-relay"


def relay_data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir).expanduser() if args.data_dir else default_relay_data_dir()


__all__ = [
    "RELAY_DATA_DIR_ENV",
    "default_relay_data_dir",
    "locked_node_data_dir",
    "node_data_dir",
    "relay_data_dir",
]
