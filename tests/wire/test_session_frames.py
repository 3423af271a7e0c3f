import numpy as np
import pytest

from meshnode.wire.conformance import golden_session_request
from meshnode.wire.errors import PayloadCorrupt
from meshnode.wire.pb import shard
from meshnode.wire.session_frames import parse_session_request
from meshnode.wire.tensor_codec import decode_bundle, decode_bundle_bytes


def test_chunk_envelope_parsed_and_bundle_left_as_a_view():
    request = golden_session_request()
    frame = request.SerializeToString()
    received = parse_session_request(frame)
    assert received.request.chunk.envelope == request.chunk.envelope
    assert not received.request.chunk.HasField("bundle")
    assert received.bundle_bytes is not None
    direct = decode_bundle(request.chunk.bundle)
    via_view = decode_bundle_bytes(received.bundle_bytes, zero_copy=True)
    for name, tensor in direct.items():
        assert np.array_equal(via_view[name].array, tensor.array)


def test_other_kinds_parse_whole():
    decode = shard.SessionRequest(decode=shard.DecodeStep(idempotency_step=7, position=12))
    received = parse_session_request(decode.SerializeToString())
    assert received.request == decode and received.bundle_bytes is None
    cancel = shard.SessionRequest(cancel=shard.CancelSignal(route_session_id="s", reason="user"))
    assert parse_session_request(cancel.SerializeToString()).request == cancel


def test_last_oneof_member_wins_like_the_runtime():
    chunk = golden_session_request().SerializeToString()
    release = shard.SessionRequest(release=shard.ReleaseSignal(route_session_id="s")).SerializeToString()
    assert parse_session_request(chunk + release).request.WhichOneof("kind") == "release"
    assert parse_session_request(release + chunk).request.WhichOneof("kind") == "chunk"


@pytest.mark.parametrize("frame", [b"\x12\xff\xff\xff\x7f", b"\x12\x05\x12\x10abc", b"\x0f"])
def test_malformed_frames_are_payload_corrupt(frame):
    with pytest.raises(PayloadCorrupt) as info:
        parse_session_request(frame)
    assert info.value.code == shard.ERROR_CODE_PAYLOAD_CORRUPT
