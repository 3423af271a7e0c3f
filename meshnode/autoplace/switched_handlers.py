"""The shard's stream handlers, registered with the node once and pointed at whichever shard serves.

A node's dispatcher takes one handler per stream type for the node's life, but a node
that moves to another layer range replaces its shard server. The node gets a
trampoline per stream type; each shard service registers its handlers here, and a
stream that arrives while no shard serves (between ranges) is refused as overloaded,
which a head treats like a busy hop and routes around.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshnode.mesh.dispatcher import StreamHandler
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

NodeRegister = Callable[[StreamType, StreamHandler], None]


class SwitchedHandlers:
    def __init__(self, node_register: NodeRegister) -> None:
        self._node_register = node_register
        self._current: dict[StreamType, StreamHandler] = {}
        self._trampolines: set[StreamType] = set()

    def register(self, stream_type: StreamType, handler: StreamHandler) -> None:
        """Serve ``stream_type`` with ``handler`` until :meth:`clear` (a shard server's ``Register``)."""
        if stream_type not in self._trampolines:
            self._node_register(stream_type, self._trampoline(stream_type))
            self._trampolines.add(stream_type)
        self._current[stream_type] = handler

    def clear(self) -> None:
        """No shard serves: refuse shard streams until the next one registers."""
        self._current.clear()

    def _trampoline(self, stream_type: StreamType) -> StreamHandler:
        async def serve(stream: FramedStream) -> None:
            handler = self._current.get(stream_type)
            if handler is None:
                raise MeshRefusal(mesh.MESH_ERROR_OVERLOADED, "this node is between layer ranges")
            await handler(stream)

        return serve


class SwitchedNode:
    """A node whose ``register_handler`` goes through :class:`SwitchedHandlers`: what a shard
    service is started on when the range it serves can change."""

    def __init__(self, node: Any, handlers: SwitchedHandlers) -> None:
        self._node = node
        self.register_handler = handlers.register
        self.node_id: bytes = node.node_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


__all__ = ["SwitchedHandlers", "SwitchedNode"]
