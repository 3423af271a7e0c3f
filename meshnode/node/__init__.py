"""The node: one process's identity, QUIC endpoint, dispatcher and membership, on asyncio.

:mod:`~meshnode.node.runtime` is the :class:`Node` itself, which composes its parts:
the links (:mod:`~meshnode.node.peer_connections`), gossip, the heartbeat, liveness,
the membership's keeper and the status; each lives beside it, or in the layers below. Its names are loaded here on first use: the command line reads
:mod:`~meshnode.node.config` without loading the node (and QUIC with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshnode.node.config import DEFAULT_LISTEN, DEFAULT_PORT, JoinError, NodeConfig

if TYPE_CHECKING:
    from meshnode.node.runtime import Node, PeerUnreachable


def __getattr__(name: str) -> Any:
    if name in ("Node", "PeerUnreachable"):
        from meshnode.node import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "JoinError", "Node", "NodeConfig", "PeerUnreachable"]
