"""The node: one process's identity, QUIC endpoint, dispatcher and membership, on asyncio.

:mod:`~meshnode.node.runtime` is the :class:`Node` itself (gossip, liveness, the
mesh's own stream handlers, persistence); what it is made of lives beside it or
in the layers below.
"""

from meshnode.node.runtime import DEFAULT_LISTEN, DEFAULT_PORT, JoinError, Node, NodeConfig, PeerUnreachable

__all__ = ["DEFAULT_LISTEN", "DEFAULT_PORT", "JoinError", "Node", "NodeConfig", "PeerUnreachable"]
