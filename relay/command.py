"""``meshnode relay`` and ``python -m relay``: run a relay for one or more meshes.

    meshnode relay --listen 0.0.0.0:7448 --mesh MESH_ID [--mesh MESH_ID ...] [--data-dir DIR]
                   [--metrics-listen HOST:PORT]
    meshnode relay --show-id [--data-dir DIR]

The relay's identity key lives in its data directory (created on first use,
mode 0600); its id is what invites pin. On start the relay prints
``relay id: <hex>`` and ``relay listening on HOST:PORT`` to stdout, and with
``--metrics-listen`` then ``relay metrics on http://HOST:PORT/metrics``.

The relay program's composition: its options, the server (relay.server), the status socket
that answers ``meshnode status`` for it (relay.status) and its metrics endpoint
(relay.metrics). ``python -m relay`` runs :func:`main`; the ``meshnode`` command line lists
this module among its subcommands (:func:`register`). What it shares with that command line
(argument types, the common options, data directories) comes from meshnode.commandline, below
the node, so that the relay never imports the app.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from meshnode.commandline.argument_types import host_port, mesh_id, positive_int
from meshnode.commandline.common_options import common_options
from meshnode.commandline.data_dirs import RELAY_DATA_DIR_ENV, relay_data_dir
from meshnode.commandline.event_loop import run_async
from meshnode.commandline.read_limit_options import add_read_limit_options, apply_read_limit_options
from meshnode.identity import IdentityError
from meshnode.logs import configure_logging
from meshnode.membership.store import StoreError
from meshnode.transport.addresses import format_host_port, parse_host_port
from meshnode.transport.bind_errors import ListenError
from relay.core import RelayPolicy

if TYPE_CHECKING:
    from meshnode.statussocket.server import StatusServer

DEFAULT_LISTEN = "0.0.0.0:7448"
log = logging.getLogger(__name__)


def _keepalive(text: str) -> float:
    value = float(text)
    if not 0 < value < 30:
        raise argparse.ArgumentTypeError(
            "keepalive must be between 0 and 30 s (UDP NAT mappings expire at 30 s)"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=host_port,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"UDP address (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_id,
        action="append",
        default=[],
        metavar="MESH_ID",
        help="serve this mesh (repeatable); only its members may register",
    )
    parser.add_argument(
        "--metrics-listen",
        type=host_port,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP at /metrics on this address (default: none)",
    )
    parser.add_argument(
        "--show-id", action="store_true", help="print the relay id (creating the key) and exit"
    )
    parser.add_argument(
        "--keepalive",
        type=_keepalive,
        default=RelayPolicy.keepalive_s,
        metavar="S",
        help="QUIC PING interval (default 10)",
    )
    strangers = parser.add_argument_group("connections not registered yet (anyone can open one)")
    strangers.add_argument(
        "--max-unregistered",
        type=positive_int,
        default=RelayPolicy.max_unregistered,
        metavar="N",
        help=f"at most this many at once (default {RelayPolicy.max_unregistered})",
    )
    strangers.add_argument(
        "--max-unregistered-per-source",
        type=positive_int,
        default=RelayPolicy.max_unregistered_per_source,
        metavar="N",
        help="at most this many from one IP address (an IPv6 /64) "
        f"(default {RelayPolicy.max_unregistered_per_source})",
    )
    add_read_limit_options(parser)


async def run_relay(args: argparse.Namespace) -> int:
    # QUIC, and aiohttp for the metrics, load here: not for every command the CLI reads.
    from relay.metrics import METRICS_PATH, RelayMetricsServer
    from relay.server import RelayServer, load_relay_identity
    from relay.status import answer_relay_status

    try:
        identity, created = load_relay_identity(relay_data_dir(args))
    except IdentityError as exc:
        print(f"meshnode relay: {exc}", file=sys.stderr)
        return 1
    if args.show_id:
        print(identity.node_id.hex())
        return 0
    if not args.mesh:
        print("meshnode relay: at least one --mesh MESH_ID is required", file=sys.stderr)
        return 2
    if created:
        log.info("created relay identity in %s", relay_data_dir(args))
    host, port = parse_host_port(args.listen, allow_zero_port=True)
    try:
        policy = RelayPolicy(
            keepalive_s=args.keepalive,
            max_unregistered=args.max_unregistered,
            max_unregistered_per_source=args.max_unregistered_per_source,
        )
    except ValueError as exc:
        print(f"meshnode relay: {exc}", file=sys.stderr)
        return 2
    try:
        server = RelayServer(
            identity,
            set(args.mesh),
            policy,
            quic=apply_read_limit_options(args),
            data_dir=relay_data_dir(args),
        )
    except (StoreError, IdentityError) as exc:
        print(f"meshnode relay: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    metrics: RelayMetricsServer | None = None
    status: StatusServer | None = None
    try:
        try:
            await server.start(host, port)
        except ListenError as exc:
            print(f"meshnode relay: {exc}; choose another with --listen HOST:PORT", file=sys.stderr)
            return 1
        if args.metrics_listen is not None:
            metrics = RelayMetricsServer(server)
            metrics_host, metrics_port = parse_host_port(args.metrics_listen, allow_zero_port=True)
            try:
                await metrics.start(metrics_host, metrics_port)
            except OSError as exc:
                where = format_host_port(metrics_host, metrics_port)
                print(
                    f"meshnode relay: cannot serve metrics on {where}: {exc.strerror or exc}", file=sys.stderr
                )
                return 1
        metrics_url = f"http://{format_host_port(*metrics.address)}{METRICS_PATH}" if metrics else None
        # Answering status before saying it listens: whoever reads the lines below can ask at once.
        status = await answer_relay_status(relay_data_dir(args), server, metrics_url)
        bound_host, bound_port = server.address
        print(f"relay id: {identity.node_id.hex()}", flush=True)
        print(f"relay listening on {format_host_port(bound_host, bound_port)}", flush=True)
        if metrics_url is not None:
            print(f"relay metrics on {metrics_url}", flush=True)
        await stop.wait()
        log.info("relay stopping")
        return 0
    finally:
        if status is not None:
            status.close()
        if metrics is not None:
            await metrics.close()
        await server.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


RELAY_DATA_DIR_HELP = f"relay state directory, holding its identity key (default ${RELAY_DATA_DIR_ENV} or ~/.local/share/meshnode-relay)"


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    parser = subparsers.add_parser(
        "relay",
        # Not ``common``: a relay keeps its identity in a directory of its own.
        parents=[common_options(RELAY_DATA_DIR_HELP)],
        help="run a relay for NATed mesh members",
        description="Forward sealed frames between members of the given meshes that cannot dial each other.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run_relay)


def main(argv: list[str] | None = None) -> int:
    """``python -m relay``: the relay alone, without the rest of the ``meshnode`` command line."""
    parser = argparse.ArgumentParser(prog="python -m relay", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", metavar="DIR", help=RELAY_DATA_DIR_HELP)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"])
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        return run_async(run_relay(args))
    except KeyboardInterrupt:
        return 130


__all__ = ["add_arguments", "main", "register", "run_relay"]
