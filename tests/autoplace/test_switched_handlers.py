"""A node that moves to another range points its shard streams at the new shard server."""

from __future__ import annotations

import pytest

from meshnode.autoplace.switched_handlers import SwitchedHandlers, SwitchedNode
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh


class Registry:
    def __init__(self) -> None:
        self.handlers: dict[StreamType, object] = {}

    def register_handler(self, stream_type: StreamType, handler: object) -> None:
        assert stream_type not in self.handlers, "the node takes one handler per stream type"
        self.handlers[stream_type] = handler


async def test_each_shard_servers_handlers_serve_until_cleared_then_streams_are_refused_as_overloaded():
    registry = Registry()
    switched = SwitchedHandlers(registry.register_handler)
    served: list[str] = []

    async def first(stream: object) -> None:
        served.append("first")

    async def second(stream: object) -> None:
        served.append("second")

    switched.register(StreamType.SHARD_SESSION, first)
    trampoline = registry.handlers[StreamType.SHARD_SESSION]
    await trampoline(object())
    switched.clear()
    with pytest.raises(MeshRefusal) as refused:
        await trampoline(object())
    assert refused.value.code == mesh.MESH_ERROR_OVERLOADED
    # The next range's server registers again; the node is not asked twice.
    switched.register(StreamType.SHARD_SESSION, second)
    await trampoline(object())
    assert served == ["first", "second"]


def test_a_switched_node_is_the_node_but_for_where_handlers_register():
    class FakeNode:
        node_id = b"n" * 32

        def set_load(self, load: object) -> str:
            return "node's"

    registry = Registry()
    switched = SwitchedHandlers(registry.register_handler)
    node = SwitchedNode(FakeNode(), switched)
    assert node.node_id == b"n" * 32
    assert node.set_load(None) == "node's"
    assert node.register_handler == switched.register
