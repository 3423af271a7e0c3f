"""A mesh stream handler's one request frame, awaited on the stream and decoded in one place."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

from meshnode.mesh.validation import decode
from meshnode.transport.framed import FramedStream
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

M = TypeVar("M", bound=Message)


async def read_message(stream: FramedStream, message_type: type[M], timeout: float | None) -> M:
    """The stream's next frame as ``message_type``; waits at most ``timeout``.

    A stream that ends before the frame, or a frame that does not decode, is a
    MALFORMED :class:`~meshnode.wire.mesh_refusal.MeshRefusal` (the dispatcher
    resets the stream with its code); a slow peer is a ``TimeoutError``.
    """
    data = await stream.recv_frame(timeout)
    if data is None:
        raise MeshRefusal(mesh.MESH_ERROR_MALFORMED, f"stream ended before the {message_type.__name__}")
    return decode(message_type, data)


__all__ = ["read_message"]
