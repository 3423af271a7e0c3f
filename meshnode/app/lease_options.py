"""The command-line options of session leases (:mod:`meshnode.dataplane.lease`) for the commands that serve a shard.

``--link-timeout`` bounds how long a peer that vanished without a word (SIGKILL,
power cut, network gone) keeps a link open, and with it the sessions it opened
here. QUIC closes a link that heard nothing for the idle timeout, counted from
the first keepalive sent after the last packet received (keepalives are due a
third of it after that packet, checked every sixth), so a silent peer's link
closes within about 1.5 times it, and its sessions end ``--session-grace``
later. ``--session-idle-timeout`` and ``--peer-session-share`` are the
worker's lease and share rules, and ``--session-grace`` how long a session
whose owner seems gone waits for it to show up again.
"""

from __future__ import annotations

import argparse

from meshnode.commandline.argument_types import non_negative, positive, share
from meshnode.dataplane.lease import LeaseConfig
from meshnode.transport.quic_config import QuicConfig

DEFAULT_LINK_TIMEOUT_S = 10.0
_DEFAULTS = LeaseConfig()
# Keepalives must stay under the 30 s after which Linux forgets an unanswered UDP NAT mapping.
_MAX_KEEPALIVE_S = 10.0


def add_lease_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("session leases")
    group.add_argument(
        "--link-timeout",
        type=positive,
        default=DEFAULT_LINK_TIMEOUT_S,
        metavar="SECONDS",
        help="a peer silent this long is gone: its link closes and the sessions it opened here end "
        f"(keepalives go out at a third of it; default {DEFAULT_LINK_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--session-idle-timeout",
        type=positive,
        default=_DEFAULTS.idle_timeout_s,
        metavar="SECONDS",
        help="drop a session no frame arrived for in this long; a unit's deadline shortens it "
        f"(default {_DEFAULTS.idle_timeout_s:g})",
    )
    group.add_argument(
        "--peer-session-share",
        type=share,
        default=None,
        metavar="FRACTION",
        help="most of this shard's sessions one peer other than this node may hold, so the node's own "
        f"API keeps room (default {_DEFAULTS.peer_share:g}, 3 of 4, on a node serving the API; "
        "1 on a node without one, whose every session comes from peers)",
    )
    group.add_argument(
        "--session-grace",
        type=non_negative,
        default=_DEFAULTS.owner_grace_s,
        metavar="SECONDS",
        help="a session whose owner seems gone (link lost, confirmed down, left) waits this long for it "
        f"to show up again before it ends (default {_DEFAULTS.owner_grace_s:g})",
    )


def lease_settings(args: argparse.Namespace, *, serves_api: bool) -> LeaseConfig:
    """The lease rules; the share is kept back only for a node's own API users, so a node
    without an API lets one upstream hop use every session (a chain's capacity)."""
    chosen = args.peer_session_share
    if chosen is None:
        chosen = _DEFAULTS.peer_share if serves_api else 1.0
    return LeaseConfig(
        idle_timeout_s=float(args.session_idle_timeout),
        peer_share=float(chosen),
        owner_grace_s=float(args.session_grace),
    )


def link_settings(args: argparse.Namespace) -> QuicConfig:
    """The node's QUIC settings: idle timeout ``--link-timeout``, keepalives well inside it."""
    timeout = float(args.link_timeout)
    return QuicConfig(idle_timeout=timeout, keepalive_interval=min(timeout / 3, _MAX_KEEPALIVE_S))


__all__ = [
    "DEFAULT_LINK_TIMEOUT_S",
    "add_lease_options",
    "lease_settings",
    "link_settings",
]
