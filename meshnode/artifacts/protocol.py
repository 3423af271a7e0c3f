"""The ARTIFACT stream's messages, sans-IO: encoding, and validation right after every decode.

Both directions distrust the other side. A server checks a request's shape before it
looks anything up (:func:`parse_request`). A receiver never sizes anything from what a
peer announces: a manifest reply is capped (tensor count, name length, shapes) before it
is turned into a :class:`~engines.model_manifest.ModelManifest`, and that manifest must
hash to the root that was asked for (:func:`verified_manifest`); after that, every
expected size (the metadata blob's, each tensor's) comes from the verified manifest, and
a :class:`ChunkReceiver` accepts exactly that many bytes, in order, and nothing more.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from engines.gguf_file import GGUFFormatError, tensor_nbytes
from engines.model_manifest import ModelManifest, TensorDigest
from meshnode.gen.meshnode.v1 import artifacts_pb2 as pb
from meshnode.wire.framing import MAX_FRAME_BYTES, NODE_PROTOCOL_GENERATION

ROOT_BYTES = 32
DIGEST_BYTES = 32
# Data per chunk frame: small enough to interleave uploads and pace them finely,
# large enough that per-frame costs vanish against the copy.
CHUNK_BYTES = 256 * 1024
# Caps checked on a manifest reply before anything is built from it. A GGUF of a large
# mixture-of-experts model has a few thousand tensors; names are at most 64 bytes in ggml.
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 256
MAX_DIMS = 4
# Gemma 3's 262k-token vocabulary makes about 6 MB of metadata.
MAX_METADATA_BYTES = 64 * 1024 * 1024

ArtifactErrorCode = pb.ArtifactErrorCode
UNKNOWN_MODEL = pb.ARTIFACT_ERROR_UNKNOWN_MODEL
NOT_HELD = pb.ARTIFACT_ERROR_NOT_HELD
BAD_REQUEST = pb.ARTIFACT_ERROR_BAD_REQUEST
OVERLOADED = pb.ARTIFACT_ERROR_OVERLOADED


class ArtifactError(Exception):
    """Base of this package's protocol errors."""


class ArtifactRefusal(ArtifactError):
    """A request refused with a code: raised by the server's checks, sent as an ``ArtifactRefusal``."""

    def __init__(self, code: pb.ArtifactErrorCode, detail: str = "") -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{pb.ArtifactErrorCode.Name(code)}: {detail}" if detail else self.code_name)

    @property
    def code_name(self) -> str:
        return pb.ArtifactErrorCode.Name(self.code)


class PeerRefused(ArtifactRefusal):
    """The peer answered with an ``ArtifactRefusal`` (the client's view of one)."""


class BadReply(ArtifactError):
    """A peer's reply breaks the protocol or disagrees with the verified manifest."""


# ---------------------------------------------------------------------------------- requests


class MetadataItem(enum.Enum):
    """The fetchable item that is not a tensor: the metadata blob."""

    BLOB = "metadata"


Item = MetadataItem | int


@dataclass(frozen=True)
class ManifestRequest:
    root: bytes


@dataclass(frozen=True)
class FetchRequest:
    root: bytes
    item: Item
    offset: int
    # 0: to the end of the item.
    length: int


def encode_manifest_query(root: bytes) -> bytes:
    if len(root) != ROOT_BYTES:
        raise ValueError(f"a model root is {ROOT_BYTES} bytes")
    request = pb.ArtifactRequest(gen=NODE_PROTOCOL_GENERATION, manifest=pb.ManifestQuery(root=root))
    return request.SerializeToString()


def encode_fetch(root: bytes, item: Item, offset: int = 0, length: int = 0) -> bytes:
    fetch = pb.ArtifactFetch(root=root, offset=offset, length=length)
    if item is MetadataItem.BLOB:
        fetch.metadata = True
    else:
        fetch.tensor_index = item
    return pb.ArtifactRequest(gen=NODE_PROTOCOL_GENERATION, fetch=fetch).SerializeToString()


def parse_request(body: bytes) -> ManifestRequest | FetchRequest:
    """The request in ``body``; :class:`ArtifactRefusal` (BAD_REQUEST) for anything malformed."""
    request = pb.ArtifactRequest()
    try:
        request.ParseFromString(body)
    except DecodeError:
        raise ArtifactRefusal(BAD_REQUEST, "request does not decode") from None
    if request.gen != NODE_PROTOCOL_GENERATION:
        raise ArtifactRefusal(BAD_REQUEST, f"gen {request.gen} is not {NODE_PROTOCOL_GENERATION}")
    kind = request.WhichOneof("kind")
    if kind == "manifest":
        _check_root(request.manifest.root)
        return ManifestRequest(request.manifest.root)
    if kind == "fetch":
        fetch = request.fetch
        _check_root(fetch.root)
        which = fetch.WhichOneof("item")
        if which == "metadata" and fetch.metadata:
            item: Item = MetadataItem.BLOB
        elif which == "tensor_index":
            item = fetch.tensor_index
        else:
            raise ArtifactRefusal(BAD_REQUEST, "fetch names no item")
        return FetchRequest(fetch.root, item, fetch.offset, fetch.length)
    raise ArtifactRefusal(BAD_REQUEST, "request is neither a manifest query nor a fetch")


def resolve_range(item_nbytes: int, offset: int, length: int) -> tuple[int, int]:
    """``(offset, length)`` of a fetch inside an item of ``item_nbytes``; BAD_REQUEST outside it."""
    length = item_nbytes - offset if length == 0 else length
    if offset > item_nbytes or length < 0 or offset + length > item_nbytes:
        raise ArtifactRefusal(
            BAD_REQUEST, f"range [{offset}, +{length}) is outside the item's {item_nbytes} bytes"
        )
    return offset, length


def _check_root(root: bytes) -> None:
    if len(root) != ROOT_BYTES:
        raise ArtifactRefusal(BAD_REQUEST, f"a model root is {ROOT_BYTES} bytes, not {len(root)}")


# ----------------------------------------------------------------------------------- replies


def encode_manifest_reply(manifest: ModelManifest, metadata_nbytes: int, held: frozenset[int]) -> bytes:
    tensors = [
        pb.ArtifactTensor(
            name=t.name,
            ggml_type=t.ggml_type,
            shape=list(t.shape),
            nbytes=t.nbytes,
            sha256=bytes.fromhex(t.sha256),
        )
        for t in manifest.tensors
    ]
    reply = pb.ArtifactManifest(
        gguf_version=manifest.gguf_version,
        metadata_nbytes=metadata_nbytes,
        metadata_sha256=bytes.fromhex(manifest.metadata_sha256),
        tensors=tensors,
        held=sorted(held),
    )
    return pb.ArtifactReply(gen=NODE_PROTOCOL_GENERATION, manifest=reply).SerializeToString()


def encode_chunk(offset: int, data: bytes) -> bytes:
    reply = pb.ArtifactReply(gen=NODE_PROTOCOL_GENERATION)
    # Filled in place: a chunk message passed to the reply would be copied into it, data and all.
    reply.chunk.offset = offset
    reply.chunk.data = data
    return reply.SerializeToString()


def encode_end(sent: int) -> bytes:
    end = pb.ArtifactEnd(sent=sent)
    return pb.ArtifactReply(gen=NODE_PROTOCOL_GENERATION, end=end).SerializeToString()


def encode_refusal(refusal: ArtifactRefusal) -> bytes:
    sent = pb.ArtifactRefusal(code=refusal.code, detail=refusal.detail)
    return pb.ArtifactReply(gen=NODE_PROTOCOL_GENERATION, refusal=sent).SerializeToString()


def parse_reply(body: bytes) -> pb.ArtifactReply:
    """A decoded reply with the right gen; a refusal raises :class:`PeerRefused`."""
    reply = pb.ArtifactReply()
    try:
        reply.ParseFromString(body)
    except DecodeError:
        raise BadReply("reply does not decode") from None
    if reply.gen != NODE_PROTOCOL_GENERATION:
        raise BadReply(f"reply gen {reply.gen} is not {NODE_PROTOCOL_GENERATION}")
    if reply.WhichOneof("kind") == "refusal":
        code = reply.refusal.code
        if code not in pb.ArtifactErrorCode.values() or code == pb.ARTIFACT_ERROR_UNSPECIFIED:
            raise BadReply(f"refusal with unknown code {code}")
        raise PeerRefused(code, reply.refusal.detail[:200])
    return reply


# ------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class PeerManifest:
    """A manifest reply that hashed to the requested root, and what that peer holds of it."""

    manifest: ModelManifest
    metadata_nbytes: int
    held: frozenset[int]


def verified_manifest(reply: pb.ArtifactReply, root: bytes) -> PeerManifest:
    """The manifest in ``reply`` if it is the model ``root`` names; :class:`BadReply` otherwise."""
    if reply.WhichOneof("kind") != "manifest":
        raise BadReply("expected a manifest reply")
    wire = reply.manifest
    # Caps first: nothing below builds more than these allow.
    if len(wire.tensors) > MAX_TENSORS:
        raise BadReply(f"{len(wire.tensors)} tensors is more than {MAX_TENSORS}")
    if not 0 < wire.metadata_nbytes <= MAX_METADATA_BYTES:
        raise BadReply(f"metadata of {wire.metadata_nbytes} bytes is outside (0, {MAX_METADATA_BYTES}]")
    if len(wire.metadata_sha256) != DIGEST_BYTES:
        raise BadReply("metadata digest is not 32 bytes")
    tensors = []
    for index, tensor in enumerate(wire.tensors):
        if len(tensor.name.encode()) > MAX_NAME_BYTES:
            raise BadReply(f"tensor {index}'s name is longer than {MAX_NAME_BYTES} bytes")
        if not 1 <= len(tensor.shape) <= MAX_DIMS or len(tensor.sha256) != DIGEST_BYTES:
            raise BadReply(f"tensor {index} has {len(tensor.shape)} dimensions or a bad digest")
        shape = tuple(tensor.shape)
        try:
            expected = tensor_nbytes(shape, tensor.ggml_type)
        except GGUFFormatError as error:
            raise BadReply(f"tensor {index}: {error}") from None
        if tensor.nbytes != expected:
            raise BadReply(f"tensor {index} claims {tensor.nbytes} bytes, its shape and type make {expected}")
        tensors.append(TensorDigest(tensor.name, tensor.ggml_type, shape, tensor.nbytes, tensor.sha256.hex()))
    manifest = ModelManifest(wire.gguf_version, wire.metadata_sha256.hex(), tuple(tensors))
    if bytes.fromhex(manifest.root) != root:
        raise BadReply("manifest does not hash to the requested root")
    if len(set(name.name for name in tensors)) != len(tensors):
        raise BadReply("manifest names a tensor twice")
    held = frozenset(wire.held)
    if any(index >= len(tensors) for index in held):
        raise BadReply("held index outside the manifest")
    return PeerManifest(manifest, wire.metadata_nbytes, held)


# --------------------------------------------------------------------------------- chunks


class ChunkReceiver:
    """Accepts exactly the bytes ``[offset, offset + length)`` of an item, in order, then an end.

    ``length`` comes from the verified manifest, never from the peer. Each :meth:`accept`
    returns the data to write (or ``None`` for the end marker); anything out of order, too
    long, or an end before the last byte raises :class:`BadReply`.
    """

    def __init__(self, offset: int, length: int) -> None:
        self.next_offset = offset
        self.end_offset = offset + length
        self.received = 0
        self.finished = False

    @property
    def complete(self) -> bool:
        return self.next_offset == self.end_offset

    def accept(self, reply: pb.ArtifactReply) -> bytes | None:
        if self.finished:
            raise BadReply("frame after the end marker")
        kind = reply.WhichOneof("kind")
        if kind == "end":
            if not self.complete or reply.end.sent != self.received:
                raise BadReply(f"end marker at {self.next_offset} of {self.end_offset}")
            self.finished = True
            return None
        if kind != "chunk":
            raise BadReply(f"expected a chunk, got {kind}")
        chunk = reply.chunk
        data = chunk.data
        if chunk.offset != self.next_offset:
            raise BadReply(f"chunk at offset {chunk.offset}, expected {self.next_offset}")
        if not data or len(data) > CHUNK_BYTES or self.next_offset + len(data) > self.end_offset:
            raise BadReply(f"chunk of {len(data)} bytes at {chunk.offset} does not fit the item")
        self.next_offset += len(data)
        self.received += len(data)
        return data


# A chunk frame's protobuf overhead is a few bytes; this bound keeps the cap honest.
assert CHUNK_BYTES + 64 < MAX_FRAME_BYTES

__all__ = [
    "BAD_REQUEST",
    "CHUNK_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_NAME_BYTES",
    "MAX_TENSORS",
    "NOT_HELD",
    "OVERLOADED",
    "ROOT_BYTES",
    "UNKNOWN_MODEL",
    "ArtifactError",
    "ArtifactErrorCode",
    "ArtifactRefusal",
    "BadReply",
    "ChunkReceiver",
    "FetchRequest",
    "Item",
    "ManifestRequest",
    "MetadataItem",
    "PeerManifest",
    "PeerRefused",
    "encode_chunk",
    "encode_end",
    "encode_fetch",
    "encode_manifest_query",
    "encode_manifest_reply",
    "encode_refusal",
    "parse_reply",
    "parse_request",
    "resolve_range",
    "verified_manifest",
]
