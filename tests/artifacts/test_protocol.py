"""ARTIFACT messages: each malformed request or reply is refused with its exact code or error."""

from __future__ import annotations

import dataclasses

import pytest

from meshnode.artifacts.protocol import (
    BAD_REQUEST,
    CHUNK_BYTES,
    MAX_NAME_BYTES,
    MAX_TENSORS,
    NOT_HELD,
    OVERLOADED,
    UNKNOWN_MODEL,
    ArtifactRefusal,
    BadReply,
    ChunkReceiver,
    FetchRequest,
    ManifestRequest,
    MetadataItem,
    PeerRefused,
    encode_chunk,
    encode_end,
    encode_fetch,
    encode_manifest_query,
    encode_manifest_reply,
    encode_refusal,
    parse_reply,
    parse_request,
    resolve_range,
    verified_manifest,
)
from meshnode.gen.meshnode.v1 import artifacts_pb2 as pb

ROOT = bytes(range(32))


def refusal_code(body: bytes) -> int:
    with pytest.raises(ArtifactRefusal) as info:
        parse_request(body)
    return info.value.code


# ---------------------------------------------------------------------------- requests


def test_requests_round_trip():
    assert parse_request(encode_manifest_query(ROOT)) == ManifestRequest(ROOT)
    assert parse_request(encode_fetch(ROOT, 7, 10, 20)) == FetchRequest(ROOT, 7, 10, 20)
    assert parse_request(encode_fetch(ROOT, MetadataItem.BLOB)) == FetchRequest(ROOT, MetadataItem.BLOB, 0, 0)
    # Index 0 is a real tensor, not "no item" (proto3 oneof keeps presence).
    assert parse_request(encode_fetch(ROOT, 0)).item == 0


def test_malformed_requests_are_bad_requests():
    assert refusal_code(b"\xff\xff\xff") == BAD_REQUEST
    wrong_gen = pb.ArtifactRequest(gen=2, manifest=pb.ManifestQuery(root=ROOT)).SerializeToString()
    assert refusal_code(wrong_gen) == BAD_REQUEST
    short_root = pb.ArtifactRequest(gen=1, manifest=pb.ManifestQuery(root=ROOT[:31])).SerializeToString()
    assert refusal_code(short_root) == BAD_REQUEST
    no_item = pb.ArtifactRequest(gen=1, fetch=pb.ArtifactFetch(root=ROOT)).SerializeToString()
    assert refusal_code(no_item) == BAD_REQUEST
    metadata_false = pb.ArtifactRequest(gen=1, fetch=pb.ArtifactFetch(root=ROOT, metadata=False))
    assert refusal_code(metadata_false.SerializeToString()) == BAD_REQUEST
    assert refusal_code(pb.ArtifactRequest(gen=1).SerializeToString()) == BAD_REQUEST


def test_ranges_outside_the_item_are_bad_requests():
    assert resolve_range(100, 0, 0) == (0, 100)
    assert resolve_range(100, 40, 0) == (40, 60)
    assert resolve_range(100, 40, 60) == (40, 60)
    for offset, length in ((101, 0), (40, 61), (100, 1)):
        with pytest.raises(ArtifactRefusal) as info:
            resolve_range(100, offset, length)
        assert info.value.code == BAD_REQUEST


# ----------------------------------------------------------------------------- replies


@pytest.mark.parametrize("code", [UNKNOWN_MODEL, NOT_HELD, BAD_REQUEST, OVERLOADED])
def test_refusals_arrive_with_their_exact_code(code):
    with pytest.raises(PeerRefused) as info:
        parse_reply(encode_refusal(ArtifactRefusal(code, "why")))
    assert info.value.code == code
    assert info.value.detail == "why"


def test_replies_with_a_wrong_gen_or_unknown_code_are_bad():
    with pytest.raises(BadReply):
        parse_reply(pb.ArtifactReply(gen=0, end=pb.ArtifactEnd()).SerializeToString())
    with pytest.raises(BadReply):
        parse_reply(b"\x08")
    unknown = pb.ArtifactReply(gen=1, refusal=pb.ArtifactRefusal(code=99)).SerializeToString()
    with pytest.raises(BadReply):
        parse_reply(unknown)


def manifest_reply(manifest, metadata_nbytes=100, held=frozenset()) -> pb.ArtifactReply:
    return parse_reply(encode_manifest_reply(manifest, metadata_nbytes, held))


def test_a_manifest_reply_verifies_against_its_root(tiny_manifest, tiny_metadata):
    root = bytes.fromhex(tiny_manifest.root)
    answer = verified_manifest(manifest_reply(tiny_manifest, len(tiny_metadata), frozenset({0, 3})), root)
    assert answer.manifest == tiny_manifest
    assert answer.held == frozenset({0, 3})
    assert answer.metadata_nbytes == len(tiny_metadata)


def test_a_manifest_for_another_root_is_refused(tiny_manifest):
    tampered = dataclasses.replace(tiny_manifest, tensors=tiny_manifest.tensors[:-1])
    with pytest.raises(BadReply, match="root"):
        verified_manifest(manifest_reply(tampered), bytes.fromhex(tiny_manifest.root))


def test_manifest_caps_apply_before_the_manifest_is_built(tiny_manifest):
    root = bytes.fromhex(tiny_manifest.root)
    reply = manifest_reply(tiny_manifest)
    reply.manifest.tensors.extend(
        [reply.manifest.tensors[0]] * (MAX_TENSORS + 1 - len(tiny_manifest.tensors))
    )
    with pytest.raises(BadReply, match="tensors is more than"):
        verified_manifest(reply, root)
    reply = manifest_reply(tiny_manifest)
    reply.manifest.tensors[0].name = "x" * (MAX_NAME_BYTES + 1)
    with pytest.raises(BadReply, match="name is longer"):
        verified_manifest(reply, root)
    reply = manifest_reply(tiny_manifest)
    reply.manifest.tensors[0].nbytes += 1
    with pytest.raises(BadReply, match="claims"):
        verified_manifest(reply, root)
    reply = manifest_reply(tiny_manifest, metadata_nbytes=0)
    with pytest.raises(BadReply, match="metadata"):
        verified_manifest(reply, root)
    reply = manifest_reply(tiny_manifest, held=frozenset({len(tiny_manifest.tensors)}))
    with pytest.raises(BadReply, match="held index"):
        verified_manifest(reply, root)


# ------------------------------------------------------------------------------ chunks


def chunk(offset: int, data: bytes) -> pb.ArtifactReply:
    return parse_reply(encode_chunk(offset, data))


@pytest.mark.parametrize(("offset", "data"), [(0, b""), (0, b"x"), (12345, bytes(range(256)) * 4)])
def test_a_chunk_is_the_reply_message_with_its_chunk_kind_even_at_offset_0(offset: int, data: bytes):
    # Filled in place, not built from a chunk message: the same bytes, and a chunk even when every
    # field of it has its default value.
    built = pb.ArtifactReply(gen=1, chunk=pb.ArtifactChunk(offset=offset, data=data))
    assert encode_chunk(offset, data) == built.SerializeToString()
    assert chunk(offset, data).WhichOneof("kind") == "chunk"


def test_a_chunk_receiver_takes_exactly_the_range_in_order():
    receiver = ChunkReceiver(10, 6)
    assert receiver.accept(chunk(10, b"abc")) == b"abc"
    assert receiver.accept(chunk(13, b"def")) == b"def"
    assert receiver.accept(parse_reply(encode_end(6))) is None
    assert receiver.finished
    with pytest.raises(BadReply):
        receiver.accept(chunk(16, b"g"))


@pytest.mark.parametrize(
    "frames",
    [
        [chunk(1, b"a")],  # out of order
        [chunk(0, b"abcdefg")],  # past the end
        [chunk(0, b"abc"), parse_reply(encode_end(3))],  # end too early
        [chunk(0, b"")],  # empty chunk
        [chunk(0, b"abc"), chunk(3, b"def"), parse_reply(encode_end(5))],  # end miscounts
    ],
)
def test_a_chunk_receiver_refuses_what_breaks_the_range(frames):
    receiver = ChunkReceiver(0, 6)
    with pytest.raises(BadReply):
        for frame in frames:
            receiver.accept(frame)


def test_a_chunk_larger_than_the_chunk_size_is_refused():
    receiver = ChunkReceiver(0, 2 * CHUNK_BYTES)
    with pytest.raises(BadReply):
        receiver.accept(chunk(0, bytes(CHUNK_BYTES + 1)))
