"""The ``meshnode`` command line.

Subcommands come from modules. Each module in :data:`COMMAND_MODULES` exposes
``register(subparsers, common)``: it adds its parsers (passing ``parents=[common]``
gives them ``--data-dir`` and ``--log-level``) and sets ``handler`` with
``parser.set_defaults(handler=fn)``, where ``fn(args)`` returns an exit code or
is a coroutine function returning one (run on uvloop when installed). To add a
subcommand (``relay``, ``generate``, ``demo``, ...), write such a module and add
its name to :data:`COMMAND_MODULES`.

Exit codes: 0 ok, 1 error, 2 bad input (e.g. an invite refused before dialing),
3 the mesh refused to admit us.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from meshnode import __version__
from meshnode.cli_args import (
    add_weight_repack_option,
    host_port,
    parse_duration,
    parse_layers,
    positive,
    relay_endpoint,
)
from meshnode.config import ConfigError, add_config_option, parse_args_with_config
from meshnode.dataplane.lease_options import add_lease_options, lease_settings, link_settings
from meshnode.identity import (
    IdentityError,
    default_data_dir,
    load_identity,
    load_or_create_identity,
    short_id,
)
from meshnode.logs import configure_logging
from meshnode.membership.credentials import (
    Endpoint,
    MeshKey,
    check_invite,
    create_invite,
    decode_invite_token,
    encode_invite_token,
    issue_certificate,
)
from meshnode.membership.store import DataDir, MembershipState, StoreError
from meshnode.node import DEFAULT_LISTEN, Node, NodeConfig, describe_served_model, query_status, run_node
from meshnode.transport.read_limit_options import add_read_limit_options, apply_read_limit_options
from meshnode.wire.mesh_refusal import MeshRefusal

# Modules that add subcommands; see the module docstring.
COMMAND_MODULES: tuple[str, ...] = ("relay.cli", "meshnode.head.commands", "meshnode.doctor")

INVITE_ENV = "MESHNODE_INVITE"
log = logging.getLogger("meshnode.cli")


class CliError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- argument helpers -------------------------------------------------------------------


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("network")
    group.add_argument(
        "--listen",
        type=host_port,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"UDP address for QUIC (default {DEFAULT_LISTEN}; port 0 picks a free port)",
    )
    group.add_argument(
        "--advertise",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="address peers should dial (repeatable; default: the listen address, "
        "or this host's outbound address when listening on 0.0.0.0)",
    )
    group.add_argument(
        "--not-directly-reachable",
        action="store_true",
        help="announce that peers cannot dial us (behind NAT): they use our relays",
    )
    group.add_argument(
        "--relay",
        type=relay_endpoint,
        action="append",
        default=[],
        metavar="RELAY_ID@HOST:PORT",
        help="register with this relay (repeatable; kept in the membership and put in invites)",
    )
    group.add_argument(
        "--relay-only", action="store_true", help="never dial peers directly; always go through a relay"
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", type=Path, metavar="PATH", help="GGUF model this node serves")
    model.add_argument(
        "--layers", type=parse_layers, metavar="A:B", help="layer range to serve (default: all)"
    )
    model.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers to offload (0)")
    model.add_argument("--threads", type=int, default=None, metavar="N", help="compute threads (all cores)")
    model.add_argument("--ctx", type=int, default=4096, metavar="N", help="context tokens per session (4096)")
    add_weight_repack_option(model)
    from meshnode.head.commands import add_api_listen_option

    add_api_listen_option(model)
    add_lease_options(parser)
    add_read_limit_options(parser)
    timing = parser.add_argument_group("timing (seconds; shorten for tests)")
    timing.add_argument("--heartbeat-interval", type=positive, default=5.0, help="gossip period (default 5)")
    timing.add_argument("--gossip-timeout", type=positive, default=3.0, help="wait for a gossip reply (3)")
    timing.add_argument("--probe-timeout", type=positive, default=3.0, help="wait for a probe echo (3)")
    timing.add_argument(
        "--peer-timeout", type=positive, default=None, help="probe a peer silent this long (4 heartbeats)"
    )
    timing.add_argument("--tombstone-ttl", type=positive, default=60.0, help="remember departed peers (60)")
    timing.add_argument(
        "--drain-timeout",
        type=positive,
        default=30.0,
        help="on SIGTERM, wait this long for in-flight generations before leaving (30)",
    )


def _node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        listen=args.listen,
        advertise=list(args.advertise),
        heartbeat_interval=args.heartbeat_interval,
        gossip_timeout=args.gossip_timeout,
        probe_timeout=args.probe_timeout,
        peer_timeout=args.peer_timeout,
        tombstone_ttl=args.tombstone_ttl,
        directly_reachable=not args.not_directly_reachable,
        relays=list(args.relay),
        relay_only=args.relay_only,
        quic=apply_read_limit_options(args, link_settings(args)),
    )


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()


def _locked_data_dir(args: argparse.Namespace) -> DataDir:
    data_dir = DataDir(_data_dir(args))
    try:
        data_dir.lock()
    except StoreError as exc:
        raise CliError(str(exc)) from None
    return data_dir


async def _serve(node: Node, args: argparse.Namespace) -> int:
    if args.model is None:
        if args.layers is not None:
            raise CliError("--layers needs --model", code=2)
        return await run_node(node)
    try:
        describe_served_model(args.model, args.layers)  # refuses a bad file or range before loading
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    from meshnode.dataplane.service import ShardService, ShardServiceError, ShardServiceOptions

    options = ShardServiceOptions(
        model=args.model,
        layers=args.layers,
        n_gpu_layers=args.n_gpu_layers,
        weight_repack=args.weight_repack,
        threads=args.threads,
        ctx=args.ctx,
        leases=lease_settings(args, serves_api=args.api_listen is not False),
    )
    try:
        service = await ShardService.start(
            node, options, refresh_interval_s=args.heartbeat_interval, is_member=node.state.is_admitted
        )
    except ShardServiceError as exc:
        raise CliError(str(exc)) from None
    try:
        head = await _start_head(node, service, args)

        async def drain() -> None:
            # The API first: it refuses new requests and waits for the generations it
            # accepted, whose sessions on this node's own shard may not be open yet;
            # only then does the shard refuse new sessions and wait for its last ones.
            if head is not None:
                await head.drain()
            await service.drain()

        try:
            return await run_node(node, drain=drain, drain_timeout=args.drain_timeout)
        finally:
            if head is not None:
                await head.aclose()
    finally:
        await service.aclose()


async def _start_head(node: Node, service: Any, args: argparse.Namespace) -> Any:
    """The API on a node serving a shard (``--api-listen``); a busy default port only warns."""
    from meshnode.head.commands import head_options
    from meshnode.head.service import HeadError, start_node_head

    if args.api_listen is False:
        return None
    try:
        return await start_node_head(node, service, args.model, head_options(args.api_listen))
    except HeadError as exc:
        if args.api_listen is not None:
            raise CliError(str(exc)) from None
        log.warning("%s; running without the API (choose another with --api-listen HOST:PORT)", exc)
        return None


# -- commands -------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    identity, created = load_or_create_identity(_data_dir(args))
    verb = "created" if created else "already have"
    print(f"{verb} node identity {identity.short_id} in {_data_dir(args)}")
    print(f"node id: {identity.node_id.hex()}")
    return 0


async def cmd_create(args: argparse.Namespace) -> int:
    data_dir = _locked_data_dir(args)
    try:
        identity, _ = load_or_create_identity(data_dir.path)
        if data_dir.has_membership():
            raise CliError(f"{data_dir.path} is already a mesh member; use `meshnode start`")
        mesh_key = MeshKey.generate()
        certificate = issue_certificate(
            mesh_key, node_id=identity.node_id, issuer_id=identity.node_id, now=time.time()
        )
        membership = MembershipState(mesh_key=mesh_key, certificate=certificate)
        data_dir.save_membership(membership)
        log.info("created mesh %s; run `meshnode invite` to invite other nodes", mesh_key.mesh_id)
        return await _serve(Node(identity, data_dir, _node_config(args), membership=membership), args)
    finally:
        data_dir.unlock()


def _read_invite_text(args: argparse.Namespace) -> str:
    text = args.invite if args.invite is not None else os.environ.get(INVITE_ENV)
    if text is None:
        raise CliError(f"join needs an invite: --invite TOKEN, --invite - (stdin) or ${INVITE_ENV}", code=2)
    return sys.stdin.readline() if text == "-" else text


async def cmd_join(args: argparse.Namespace) -> int:
    try:
        invite = decode_invite_token(_read_invite_text(args))
        check_invite(invite, now=time.time())
    except MeshRefusal as refusal:
        raise CliError(f"invite refused: {refusal.detail}", code=2) from None
    data_dir = _locked_data_dir(args)
    try:
        identity, _ = load_or_create_identity(data_dir.path)
        membership = None
        if data_dir.has_membership():
            membership = _load_membership(data_dir, identity.node_id)
            if membership.mesh_id != invite.mesh_id:
                raise CliError(
                    f"{data_dir.path} belongs to mesh {membership.mesh_id}; the invite is for mesh "
                    f"{invite.mesh_id} (use another --data-dir)"
                )
            log.info("already a member of mesh %s; starting from stored membership", membership.mesh_id)
        log.info(
            "joining mesh %s (invite from %s, %d bootstrap peer(s))",
            invite.mesh_id,
            short_id(invite.issuer_id),
            len(invite.bootstrap),
        )
        node = Node(identity, data_dir, _node_config(args), membership=membership, invite=invite)
        return await _serve(node, args)
    finally:
        data_dir.unlock()


def _load_membership(data_dir: DataDir, node_id: bytes) -> MembershipState:
    try:
        return data_dir.load_membership(node_id)
    except (StoreError, MeshRefusal) as exc:
        raise CliError(str(exc)) from None


async def cmd_start(args: argparse.Namespace) -> int:
    data_dir = _locked_data_dir(args)
    try:
        try:
            identity = load_identity(data_dir.path)
        except IdentityError as exc:
            raise CliError(str(exc)) from None
        membership = _load_membership(data_dir, identity.node_id)
        return await _serve(Node(identity, data_dir, _node_config(args), membership=membership), args)
    finally:
        data_dir.unlock()


def cmd_invite(args: argparse.Namespace) -> int:
    path = _data_dir(args)
    try:
        identity = load_identity(path)
    except IdentityError as exc:
        raise CliError(str(exc)) from None
    membership = _load_membership(DataDir(path), identity.node_id)
    bootstrap = [Endpoint(identity.node_id, address) for address in args.address]
    if not bootstrap:
        try:
            status = query_status(path)
        except OSError:
            raise CliError(
                "the node is not running; start it (the invite carries its address) or pass --address"
            ) from None
        bootstrap = [Endpoint(identity.node_id, address) for address in status["node"]["addresses"]]
        connected = [p for p in status["peers"] if p["link"] and p["addresses"]]
        bootstrap += [
            Endpoint(bytes.fromhex(p["id"]), p["addresses"][0]) for p in connected[: args.extra_peers]
        ]
    invite = create_invite(
        membership.mesh_key,
        issuer_id=identity.node_id,
        bootstrap=bootstrap,
        relays=membership.relays,
        ttl_s=args.ttl,
        now=time.time(),
    )
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(invite.expires_unix))
    print(
        f"invite for mesh {membership.mesh_id}, valid until {expires}, bootstrap: "
        + ", ".join(str(e) for e in bootstrap),
        file=sys.stderr,
    )
    print(encode_invite_token(invite))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = query_status(_data_dir(args))
    except OSError:
        raise CliError(f"no node running on {_data_dir(args)}") from None
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    node = status["node"]
    lines = [
        f"node {node['short_id']}  mesh {node['mesh_id']}  {'member' if node['member'] else 'joining'}",
        f"  addresses: {', '.join(node['addresses'])}   serving: {_serving_text(node['serving'])}",
    ]
    if node.get("api_url"):
        lines.append(f"  API: {node['api_url']}/v1 (try: meshnode generate --prompt ...)")
    lines.append(f"peers ({len(status['peers'])}):")
    for peer in sorted(status["peers"], key=lambda p: p["short_id"]):
        reach = "direct" if peer["directly_reachable"] else "relay"
        link = peer["link"] or "no link"
        lines.append(
            f"  {peer['short_id']}  {', '.join(peer['addresses']) or '-'}  {reach}  {link}  "
            f"serving {_serving_text(peer['serving'])}  heard {peer['age_s']:.1f}s ago"
        )
    return "\n".join(lines)


def _serving_text(serving: dict[str, Any] | None) -> str:
    if not serving:
        return "nothing"
    span = f"[{serving['start_layer']}:{serving['end_layer']}) of {serving['total_layers']}"
    return f"{serving['model']} {span} ({serving.get('numerics') or 'numerics unreported'})"


# -- parser ---------------------------------------------------------------------------------


def _register_node_commands(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "init",
        parents=[common],
        help="create this node's identity key",
        description="Create the node's Ed25519 "
        "identity key (mode 0600) in the data directory; does nothing if it exists.",
    )
    p.set_defaults(handler=cmd_init)

    p = subparsers.add_parser(
        "create",
        parents=[common],
        help="create a new mesh and run its first node",
        description="Create a new mesh (a fresh mesh key), make this node its first member and run it.",
    )
    _add_node_options(p)
    p.set_defaults(handler=cmd_create)

    p = subparsers.add_parser(
        "join",
        parents=[common],
        help="join a mesh with an invite and run the node",
        description="Join a mesh: dial the invite's bootstrap peers, prove the invite, receive a member "
        "certificate, then keep running. The token is a secret: prefer `--invite -` (stdin) or "
        f"${INVITE_ENV} over the command line, which other local users can see.",
    )
    p.add_argument(
        "--invite", metavar="TOKEN", help=f"invite token, or - to read it from stdin (or ${INVITE_ENV})"
    )
    _add_node_options(p)
    p.set_defaults(handler=cmd_join)

    p = subparsers.add_parser(
        "start",
        parents=[common],
        help="restart an existing member from its data directory",
        description="Run a node that is already a mesh member, reconnecting to the peers it knew.",
    )
    _add_node_options(p)
    p.set_defaults(handler=cmd_start)

    p = subparsers.add_parser(
        "invite",
        parents=[common],
        help="print an invite token for this mesh",
        description="Print an invite token (stdout) for the mesh this data directory belongs to. It names "
        "the running node (and a few of its peers) as bootstrap peers, pinned by node id.",
    )
    p.add_argument(
        "--ttl", type=parse_duration, default=24 * 3600.0, help="validity, e.g. 30m, 24h (default 24h)"
    )
    p.add_argument(
        "--address",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="bootstrap address of this node (default: ask the running node)",
    )
    p.add_argument("--extra-peers", type=int, default=3, help="also list up to N connected peers (default 3)")
    p.set_defaults(handler=cmd_invite)

    p = subparsers.add_parser(
        "status",
        parents=[common],
        help="show the running node's view of the mesh",
        description="Ask the node running on the data directory for its peers, ids, addresses, what they "
        "serve, reachability and how recently each was heard from.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_status)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        metavar="DIR",
        help=f"node state directory (default ${'MESHNODE_DATA_DIR'} or ~/.local/share/meshnode)",
    )
    common.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default info)"
    )
    common.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (default text)",
    )
    add_config_option(common)
    parser = argparse.ArgumentParser(
        prog="meshnode",
        description="Pool machines to run one large language model over a QUIC mesh.",
    )
    parser.add_argument("--version", action="version", version=f"meshnode {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_node_commands(subparsers, common)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers, common)
    return parser


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


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
    except KeyboardInterrupt:
        return 130


__all__ = ["COMMAND_MODULES", "CliError", "build_parser", "main", "parse_duration", "parse_layers"]
