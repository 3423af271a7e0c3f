"""Binds the addresses a node will listen on, and lets them go again: before ``create``
writes a mesh, and before any node loads its model.

The node binds its QUIC socket and its API only after the model has loaded, which may take
minutes. Without this check a busy port fails ``create`` after the mesh is written, and the
corrected command is then told the directory is already a member. A port taken between this
check and the real bind still fails cleanly (a :class:`ListenError` from the node's start).
"""

from __future__ import annotations

import argparse
import socket

from meshnode.commandline.cli_error import CliError
from meshnode.transport.addresses import parse_host_port
from meshnode.transport.bind_errors import ListenError, listen_error


def bind_problem(kind: socket.SocketKind, host: str, port: int) -> ListenError | None:
    """Why ``host:port`` cannot be bound now as the node would bind it (UDP for QUIC, TCP for
    the API), or None where it can."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=kind)[0]
        with socket.socket(family, kind) as probe:
            if kind == socket.SOCK_STREAM:
                # The API server sets it too: a port whose old connections linger in TIME_WAIT is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return listen_error("UDP" if kind == socket.SOCK_DGRAM else "TCP", host, port, exc)
    return None


def required_api_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """The API address the node must be able to bind: one given with ``--api-listen``, on a node
    that serves or takes layers. The default address, when busy, only warns (several nodes may
    share a machine), so it is not required."""
    if not isinstance(args.api_listen, tuple):
        return None
    return args.api_listen if args.model is not None or args.placement != "off" else None


def check_listen_addresses(args: argparse.Namespace) -> None:
    """Refuses a ``--listen`` or ``--api-listen`` address this machine cannot bind now."""
    host, port = parse_host_port(args.listen, allow_zero_port=True)
    problem = bind_problem(socket.SOCK_DGRAM, host, port)
    if problem is not None:
        raise CliError(f"{problem}; choose another with --listen HOST:PORT (port 0 picks a free one)")
    api = required_api_address(args)
    if api is not None:
        problem = bind_problem(socket.SOCK_STREAM, *api)
        if problem is not None:
            raise CliError(f"{problem}; choose another with --api-listen HOST:PORT, or 'off'")


__all__ = ["bind_problem", "check_listen_addresses", "required_api_address"]
