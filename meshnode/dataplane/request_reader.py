"""Reading a shard session stream's frames: its route, then its requests (pure).

An activation chunk's tensors are read in place (no copy of the payload); any other message,
or an unusual encoding of one, goes through protobuf. A frame that does not parse is
PAYLOAD_CORRUPT, and ends its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshnode.dataplane import errors
from meshnode.gen.meshnode.v1 import dataplane_pb2 as dataplane
from meshnode.wire.bundle_reader import read_activation_chunk
from meshnode.wire.errors import ShardProtocolError
from meshnode.wire.pb import shard
from meshnode.wire.tensor_parts import DEFAULT_LIMITS, BundleParts


@dataclass(frozen=True)
class ReadRequest:
    request: shard.SessionRequest
    # The chunk's tensors when they were read in place; None: read them from ``request``.
    bundle: BundleParts | None
    size: int

    @property
    def kind(self) -> str:
        """The request's kind (``SessionRequest.WhichOneof("kind")``), "" when it sets none."""
        return self.request.WhichOneof("kind") or ""

    def unit_label(self) -> tuple[int, str, int]:
        """A unit's idempotency step, work id and envelope deadline (unix ns, 0 for none)."""
        if self.kind == "decode":
            step = self.request.decode
            return step.idempotency_step, step.work_id, step.deadline_unix_nanos
        envelope = self.request.chunk.envelope
        return envelope.idempotency_step, envelope.work_id, envelope.deadline_unix_nanos


def read_route(body: bytes) -> dataplane.SessionRoute | ShardProtocolError:
    route = dataplane.SessionRoute()
    try:
        route.ParseFromString(body)
    except DecodeError:
        return errors.payload_corrupt("frame is not a well-formed message")
    return route


def read_request(body: bytes) -> ReadRequest | ShardProtocolError:
    request = shard.SessionRequest()
    lifted = read_activation_chunk(body, DEFAULT_LIMITS)
    try:
        if lifted is None:
            request.ParseFromString(body)
        else:
            envelope = request.chunk.envelope
            envelope.SetInParent()
            envelope.ParseFromString(lifted[0])
    except DecodeError:
        return errors.payload_corrupt("frame is not a well-formed message")
    return ReadRequest(request, None if lifted is None else lifted[1], len(body))


__all__ = ["ReadRequest", "read_request", "read_route"]
