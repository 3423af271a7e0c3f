"""Parse a received ``SessionRequest`` frame, keeping a prefill bundle zero-copy.

Prefill chunks are the only large messages on the data plane. Parsing them with
the generated classes copies the activation payload twice; instead the
envelope is parsed normally and the bundle is handed back as a view of the
frame, to be decoded with ``tensor_codec.decode_bundle_bytes``. Every other
request kind (small by construction) is parsed by the protobuf runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from meshnode.wire import protowire
from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard

_CHUNK_FIELD = shard.SessionRequest.DESCRIPTOR.fields_by_name["chunk"].number
_ENVELOPE_FIELD = shard.ActivationChunk.DESCRIPTOR.fields_by_name["envelope"].number
_BUNDLE_FIELD = shard.ActivationChunk.DESCRIPTOR.fields_by_name["bundle"].number
_ONEOF_FIELDS = {f.number for f in shard.SessionRequest.DESCRIPTOR.oneofs_by_name["kind"].fields}


@dataclass(frozen=True)
class ReceivedRequest:
    # For a chunk, ``request.chunk.bundle`` is left empty: the bundle is ``bundle_bytes``.
    request: shard.SessionRequest
    bundle_bytes: memoryview | None = None


def parse_session_request(frame: bytes) -> ReceivedRequest:
    """Raises :class:`PayloadCorrupt` when the frame is not a SessionRequest."""
    try:
        view = memoryview(frame)
        last_kind = 0
        for number, wire_type, _ in protowire.iter_fields(view):
            if number in _ONEOF_FIELDS and wire_type == protowire.LENGTH_DELIMITED:
                last_kind = number  # a oneof keeps the last member on the wire
        if last_kind != _CHUNK_FIELD:
            return ReceivedRequest(shard.SessionRequest.FromString(frame))
        envelope = shard.Envelope()
        bundle: memoryview | None = None
        for number, wire_type, value in protowire.iter_fields(view):
            if number != _CHUNK_FIELD or wire_type != protowire.LENGTH_DELIMITED:
                continue
            # Repeated occurrences of a message field merge, as in the runtime.
            assert isinstance(value, memoryview)
            for inner_number, inner_type, inner in protowire.iter_fields(value):
                if inner_type != protowire.LENGTH_DELIMITED:
                    continue
                assert isinstance(inner, memoryview)
                if inner_number == _ENVELOPE_FIELD:
                    envelope.MergeFromString(bytes(inner))
                elif inner_number == _BUNDLE_FIELD:
                    if bundle is not None:
                        raise PayloadCorrupt("chunk carries more than one bundle")
                    bundle = inner
    except (protowire.WireFormatError, DecodeError):
        raise PayloadCorrupt("session request is malformed") from None
    request = shard.SessionRequest(chunk=shard.ActivationChunk(envelope=envelope))
    return ReceivedRequest(request, bundle)
