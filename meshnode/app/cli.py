"""The ``meshnode`` command line.

Subcommands come from modules: the app's, and for ``meshnode relay`` the relay
program's own (:mod:`relay.command`, which ``python -m relay`` runs too). Each module
in :data:`COMMAND_MODULES` exposes
``register(subparsers, common)``: it adds its parsers (passing ``parents=[common]``
gives them ``--data-dir`` and ``--log-level``; the relay's own ``common_options``
describes its different state directory) and sets ``handler`` with
``parser.set_defaults(handler=fn)``, where ``fn(args)`` returns an exit code or
is a coroutine function returning one (run on uvloop when installed). To add a
subcommand (``relay``, ``generate``, ``demo``, ...), write such a module and add
it to :data:`COMMAND_MODULES`.

Exit codes: 0 ok, 1 error, 2 bad input (e.g. an invite refused before dialing),
3 the mesh refused to admit us, 4 this node was removed from the mesh (or its
certificate expired unrenewed) while running.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from meshnode import __version__
from meshnode.app import (
    api_commands,
    audit_command,
    demo,
    doctor,
    member_commands,
    node_commands,
    split_command,
    up_command,
)
from meshnode.commandline.cli_error import CliError, os_error_line
from meshnode.commandline.common_options import common_options
from meshnode.commandline.config import ConfigError, parse_args_with_config
from meshnode.commandline.event_loop import run_async
from meshnode.logs import configure_logging
from relay import command as relay_command

# Modules that add subcommands, in the order ``--help`` lists them; see the module docstring.
COMMAND_MODULES: tuple[ModuleType, ...] = (
    node_commands,
    up_command,
    member_commands,
    relay_command,
    api_commands,
    split_command,
    demo,
    doctor,
    audit_command,
)


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = argparse.ArgumentParser(
        prog="meshnode",
        description="Pool machines to run one large language model over a QUIC mesh.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args_with_config(build_parser(), argv)
    except ConfigError as exc:
        print(f"meshnode: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    handler: Callable[[argparse.Namespace], Any] = args.handler
    try:
        if inspect.iscoroutinefunction(handler):
            return run_async(handler(args))
        return int(handler(args))
    except CliError as exc:
        print(f"meshnode {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except OSError as exc:
        # The machine refused something (a full disk, a permission): say what, not where in
        # meshnode it surfaced; the traceback is kept for --log-level debug.
        logging.getLogger(__name__).debug("%s failed", args.command, exc_info=True)
        print(f"meshnode {args.command}: {os_error_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["COMMAND_MODULES", "build_parser", "main"]
