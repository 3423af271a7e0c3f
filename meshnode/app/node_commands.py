"""``meshnode init``, ``create``, ``join``, ``start``, ``invite`` and ``status``: a mesh node's own commands.

``create``, ``join`` and ``start`` run the node (:mod:`.node_serving`) until a
signal; ``invite`` and ``status`` ask the node running on the data directory
through its status socket (:mod:`.status`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshnode.app.api_options import add_api_listen_option, add_model_name_option
from meshnode.app.gossip_options import add_gossip_options, gossip_settings
from meshnode.app.join_retry import add_join_options
from meshnode.app.lease_options import add_lease_options, link_settings
from meshnode.app.listen_check import check_listen_addresses
from meshnode.app.member_commands import NOT_ADMIN, add_invite_options, list_invites, revoke_invite_command
from meshnode.app.placement_options import add_placement_options
from meshnode.app.prefix_cache_options import add_prefix_cache_options
from meshnode.app.session_options import add_session_options
from meshnode.app.status import format_status, query_node_status
from meshnode.app.stored_membership import load_stored_membership, membership_for_join
from meshnode.app.traversal_options import add_traversal_options, traversal_settings
from meshnode.app.weight_repack_option import add_weight_repack_option
from meshnode.commandline.argument_types import (
    host_port,
    non_negative_int,
    parse_invite_ttl,
    parse_layers,
    positive,
    positive_int,
    relay_endpoint,
    relay_id,
)
from meshnode.commandline.cli_error import CliError
from meshnode.commandline.data_dirs import locked_node_data_dir, node_data_dir
from meshnode.commandline.read_limit_options import add_read_limit_options, apply_read_limit_options
from meshnode.identity import IdentityError, NodeIdentity, load_identity, load_or_create_identity, short_id
from meshnode.membership.credentials import (
    DEFAULT_CERTIFICATE_TTL_S,
    Endpoint,
    Invite,
    MeshKey,
    check_invite,
    create_invite,
    decode_invite_token,
    encode_invite_token,
    issue_certificate,
)
from meshnode.membership.invite_ledger import record_issued
from meshnode.membership.store import DataDir, MembershipState
from meshnode.node.config import DEFAULT_LISTEN, NodeConfig
from meshnode.statussocket.client import query_status
from meshnode.wire.mesh_refusal import MeshRefusal

INVITE_ENV = "MESHNODE_INVITE"
log = logging.getLogger(__name__)


# -- options --------------------------------------------------------------------------------


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
        help="register with this relay (repeatable; kept in the membership and put in invites; "
        "a stored relay's address is replaced by the one given: a relay that moved)",
    )
    group.add_argument(
        "--forget-relay",
        type=relay_id,
        action="append",
        default=[],
        metavar="RELAY_ID",
        help="stop using this relay: drop it from the membership and from the invites made here "
        "(repeatable; hex id, as `meshnode status --json` lists it)",
    )
    group.add_argument(
        "--relay-only", action="store_true", help="never dial peers directly; always go through a relay"
    )
    add_traversal_options(group)
    add_gossip_options(group)
    model = parser.add_argument_group("model")
    model.add_argument("--model", type=Path, metavar="PATH", help="GGUF model this node serves")
    add_model_name_option(model)
    model.add_argument(
        "--layers", type=parse_layers, metavar="A:B", help="layer range to serve (default: all)"
    )
    model.add_argument("--n-gpu-layers", type=int, default=0, metavar="N", help="layers to offload (0)")
    model.add_argument(
        "--threads", type=positive_int, default=None, metavar="N", help="compute threads (all cores)"
    )
    model.add_argument(
        "--ctx", type=positive_int, default=4096, metavar="N", help="context tokens per session (4096)"
    )
    add_session_options(model)
    add_prefix_cache_options(model)
    add_weight_repack_option(model)
    add_api_listen_option(model)
    add_placement_options(parser)
    add_lease_options(parser)
    add_read_limit_options(parser)
    timing = parser.add_argument_group("timing (seconds; shorten for tests)")
    timing.add_argument(
        "--heartbeat-interval",
        type=positive,
        metavar="SECONDS",
        default=5.0,
        help="gossip period (default 5)",
    )
    timing.add_argument(
        "--gossip-timeout", type=positive, metavar="SECONDS", default=3.0, help="wait for a gossip reply (3)"
    )
    timing.add_argument(
        "--probe-timeout", type=positive, metavar="SECONDS", default=3.0, help="wait for a probe echo (3)"
    )
    timing.add_argument(
        "--peer-timeout",
        type=positive,
        default=None,
        metavar="SECONDS",
        help="probe a peer silent this long (4 heartbeats)",
    )
    timing.add_argument(
        "--tombstone-ttl", type=positive, metavar="SECONDS", default=60.0, help="remember departed peers (60)"
    )
    # Hidden: the lifetime of the certificates this node issues as an admin; tests shorten it.
    timing.add_argument(
        "--certificate-ttl", type=positive, default=DEFAULT_CERTIFICATE_TTL_S, help=argparse.SUPPRESS
    )
    add_join_options(timing)
    timing.add_argument(
        "--drain-timeout",
        type=positive,
        metavar="SECONDS",
        default=30.0,
        help="on SIGTERM, wait this long for in-flight generations before leaving (30)",
    )


# Public for `meshnode up` (meshnode.app.up_command), which takes the same options.
add_node_options = _add_node_options


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's settings from its command-line options."""
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
        forget_relays=list(args.forget_relay),
        relay_only=args.relay_only,
        quic=apply_read_limit_options(args, link_settings(args)),
        certificate_ttl=args.certificate_ttl,
        traversal=traversal_settings(args),
        **gossip_settings(args),
    )


# -- commands -------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    identity, created = load_or_create_identity(node_data_dir(args))
    verb = "created" if created else "already have"
    print(f"{verb} node identity {identity.short_id} in {node_data_dir(args)}")
    print(f"node id: {identity.node_id.hex()}")
    return 0


async def cmd_create(args: argparse.Namespace) -> int:
    data_dir = locked_node_data_dir(args)
    try:
        identity, _ = load_or_create_identity(data_dir.path)
        if data_dir.has_membership():
            raise CliError(f"{data_dir.path} is already a mesh member; use `meshnode start`")
        from meshnode.app.node_serving import check_serving_options  # see _run_node

        check_serving_options(args)
        check_listen_addresses(args)
        mesh_key = MeshKey.generate()
        certificate = issue_certificate(
            mesh_key,
            node_id=identity.node_id,
            issuer_id=identity.node_id,
            unix_now=time.time(),
            ttl_s=args.certificate_ttl,
            admin=True,
        )
        membership = MembershipState(mesh_key=mesh_key, certificate=certificate)
        data_dir.save_membership(membership)
        log.info("created mesh %s; run `meshnode invite` to invite other nodes", mesh_key.mesh_id)
        return await _run_node(identity, data_dir, args, membership)
    finally:
        data_dir.unlock()


async def _run_node(
    identity: NodeIdentity,
    data_dir: DataDir,
    args: argparse.Namespace,
    membership: MembershipState | None,
    invite: Invite | None = None,
) -> int:
    """Run the node until it stops. The node, and its engine and API, load here and not when
    the command line is read, so that `meshnode status` and the other quick commands (and
    the relay) do not pay a second of imports each."""
    from meshnode.app.node_serving import serve_node
    from meshnode.node.runtime import Node

    node = Node(identity, data_dir, node_config(args), membership=membership, invite=invite)
    return await serve_node(node, args)


def _read_invite_text(args: argparse.Namespace) -> str:
    text = args.invite if args.invite is not None else os.environ.get(INVITE_ENV)
    if text is None:
        raise CliError(f"join needs an invite: --invite TOKEN, --invite - (stdin) or ${INVITE_ENV}", code=2)
    return sys.stdin.readline() if text == "-" else text


async def cmd_join(args: argparse.Namespace) -> int:
    try:
        invite = decode_invite_token(_read_invite_text(args))
        check_invite(invite, unix_now=time.time())
    except MeshRefusal as refusal:
        raise CliError(f"invite refused: {refusal.detail}", code=2) from None
    data_dir = locked_node_data_dir(args)
    try:
        identity, _ = load_or_create_identity(data_dir.path)
        membership = membership_for_join(data_dir, identity.node_id, invite)
        log.info(
            "joining mesh %s (invite from %s, %d bootstrap peer(s))",
            invite.mesh_id,
            short_id(invite.issuer_id),
            len(invite.bootstrap),
        )
        return await _run_node(identity, data_dir, args, membership, invite)
    finally:
        data_dir.unlock()


async def cmd_start(args: argparse.Namespace) -> int:
    data_dir = locked_node_data_dir(args)
    try:
        try:
            identity = load_identity(data_dir.path)
        except IdentityError as exc:
            raise CliError(str(exc)) from None
        membership = load_stored_membership(data_dir, identity.node_id)
        return await _run_node(identity, data_dir, args, membership)
    finally:
        data_dir.unlock()


def cmd_invite(args: argparse.Namespace) -> int:
    if args.list:
        return list_invites(args)
    if args.revoke:
        return revoke_invite_command(args)
    path = node_data_dir(args)
    try:
        identity = load_identity(path)
    except IdentityError as exc:
        raise CliError(str(exc)) from None
    membership = load_stored_membership(DataDir(path), identity.node_id)
    if membership.mesh_key is None:
        raise CliError(NOT_ADMIN)
    bootstrap = [Endpoint(identity.node_id, address) for address in args.address]
    if not bootstrap:
        try:
            status = query_node_status(path)
        except OSError:
            raise CliError(
                "the node is not running; start it (the invite carries its address) or pass --address"
            ) from None
        bootstrap = [Endpoint(identity.node_id, address) for address in status["node"]["addresses"]]
        # Only admins admit by invite: a plain member listed as bootstrap would only refuse the joiner.
        admins = {m["id"] for m in status.get("membership", {}).get("members", []) if m["admin"]}
        connected = [p for p in status["peers"] if p["link"] and p["addresses"] and p["id"] in admins]
        bootstrap += [
            Endpoint(bytes.fromhex(p["id"]), p["addresses"][0]) for p in connected[: args.extra_peers]
        ]
    invite = create_invite(
        membership.mesh_key,
        issuer_id=identity.node_id,
        bootstrap=bootstrap,
        relays=membership.relays,
        ttl_s=args.ttl,
        unix_now=time.time(),
    )
    record_issued(path, invite)
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(invite.expires_unix))
    print(
        f"invite {short_id(invite.invite_id)} for mesh {membership.mesh_id}, valid until {expires}, bootstrap: "
        + ", ".join(str(e) for e in bootstrap),
        file=sys.stderr,
    )
    print(encode_invite_token(invite))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = query_status(node_data_dir(args))
    except OSError:
        raise CliError(f"no node running on {node_data_dir(args)}") from None
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(format_status(status))
    return 0


# -- parser ---------------------------------------------------------------------------------


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
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
        description="Print an invite token (stdout) for the mesh this data directory belongs to (admins "
        "only). It names the running node (and a few of its peers) as bootstrap peers, pinned by node "
        "id. --list shows the invites issued here; --revoke ID withdraws one.",
    )
    p.add_argument(
        "--ttl",
        type=parse_invite_ttl,
        default=24 * 3600.0,
        metavar="DURATION",
        help="validity, e.g. 30m, 24h, 7d (default 24h, at most 30d)",
    )
    p.add_argument(
        "--address",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="bootstrap address of this node (default: ask the running node)",
    )
    p.add_argument(
        "--extra-peers",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="also list up to N connected peers (default 3)",
    )
    add_invite_options(p)
    p.set_defaults(handler=cmd_invite)

    p = subparsers.add_parser(
        "status",
        parents=[common],
        help="show the running node's view of the mesh",
        description="Ask the node running on the data directory for its peers, ids, addresses, what they "
        "serve, reachability and how recently each was heard from. A `meshnode serve` process answers "
        "with what it serves and its API, a relay (--data-dir of the relay) with its registered members "
        "and what it forwarded and refused.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_status)


__all__ = ["INVITE_ENV", "add_node_options", "node_config", "register"]
