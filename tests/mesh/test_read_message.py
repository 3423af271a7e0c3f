"""read_message: a mesh handler's one request frame, decoded, or a MALFORMED refusal."""

import pytest
from helpers.mesh_helpers import Recorder

from meshnode.mesh.message_reader import read_message
from meshnode.transport.framed import FramedStream
from meshnode.transport.loopback import loopback_link_pair
from meshnode.wire.framing import StreamType
from meshnode.wire.mesh_refusal import MeshRefusal
from meshnode.wire.pb import mesh

A, B = b"\x01" * 32, b"\x02" * 32


async def served_stream(*frames: bytes, finish: bool = True) -> FramedStream:
    """The accepting side of a PROBE stream on which the opener sent ``frames``."""
    rec_a, rec_b = Recorder(), Recorder()
    a, _b = loopback_link_pair(A, B, rec_a, rec_b)
    opened = await a.open_stream(StreamType.PROBE)
    for frame in frames:
        await opened.send_frame(frame)
    if finish:
        opened.finish()
    stream = FramedStream(await rec_b.next_stream(), expect_stream_type=True)
    assert await stream.read_stream_type(1.0) is StreamType.PROBE
    return stream


async def test_the_frame_is_decoded_as_the_message():
    probe = mesh.Probe(gen=1, nonce=b"n")
    stream = await served_stream(probe.SerializeToString())
    assert await read_message(stream, mesh.Probe, 1.0) == probe


@pytest.mark.parametrize(
    ("frames", "detail"),
    [((), "stream ended before the Probe"), ((b"\xff\xff",), "Probe does not decode")],
)
async def test_no_frame_or_a_frame_that_does_not_decode_is_malformed(frames, detail):
    stream = await served_stream(*frames)
    with pytest.raises(MeshRefusal) as refused:
        await read_message(stream, mesh.Probe, 1.0)
    assert refused.value.code == mesh.MESH_ERROR_MALFORMED and refused.value.detail == detail


async def test_a_peer_that_sends_nothing_times_out():
    stream = await served_stream(finish=False)
    with pytest.raises(TimeoutError):
        await read_message(stream, mesh.Probe, 0.05)
