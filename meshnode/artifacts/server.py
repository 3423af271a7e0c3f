"""Serve the ARTIFACT stream: manifest queries and chunked uploads from :class:`Holdings`.

One request per stream. Every refusal is an ``ArtifactRefusal`` reply with its code,
so the asker learns why; the stream then ends and the node keeps serving. Tensor
bytes are read from the file one chunk at a time, each chunk paid for in the shared
:class:`~meshnode.artifacts.upload_limit.UploadLimiter` first, and each peer gets at
most ``max_uploads_per_peer`` uploads at once (OVERLOADED beyond that), so one
greedy fetcher cannot take every upload slot of the process.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from meshnode.artifacts.holdings import HeldArtifact, Holdings
from meshnode.artifacts.protocol import (
    BAD_REQUEST,
    CHUNK_BYTES,
    NOT_HELD,
    OVERLOADED,
    UNKNOWN_MODEL,
    ArtifactRefusal,
    FetchRequest,
    ManifestRequest,
    MetadataItem,
    encode_chunk,
    encode_end,
    encode_manifest_reply,
    encode_refusal,
    parse_request,
    resolve_range,
)
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.identity import short_id
from meshnode.mesh.dispatcher import StreamHandler
from meshnode.transport.framed import FramedStream
from meshnode.wire.framing import StreamType

log = logging.getLogger(__name__)

DEFAULT_MAX_UPLOADS_PER_PEER = 4
# Data per chunk frame sent (the protocol allows up to CHUNK_BYTES). Each chunk is one
# stretch of QUIC work on the event loop, holding the GIL the engine thread needs between
# its llama.cpp calls; short stretches keep the serving peer's decode steps from waiting.
UPLOAD_CHUNK_BYTES = 64 * 1024
REQUEST_TIMEOUT_S = 10.0


class HandlerRegistry(Protocol):
    def register_handler(self, stream_type: StreamType, handler: StreamHandler) -> None: ...


class ArtifactServer:
    def __init__(
        self,
        holdings: Holdings,
        limiter: UploadLimiter | None = None,
        *,
        max_uploads_per_peer: int = DEFAULT_MAX_UPLOADS_PER_PEER,
        request_timeout: float = REQUEST_TIMEOUT_S,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    ) -> None:
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"upload chunks are 1 to {CHUNK_BYTES} bytes")
        self.chunk_bytes = chunk_bytes
        self.holdings = holdings
        self.limiter = limiter or UploadLimiter()
        self.max_uploads_per_peer = max_uploads_per_peer
        self.request_timeout = request_timeout
        self._uploads: Counter[bytes] = Counter()
        self.uploaded_bytes = 0
        self.uploaded_by_peer: Counter[bytes] = Counter()
        self.refusals: Counter[str] = Counter()

    def register(self, node: HandlerRegistry) -> None:
        node.register_handler(StreamType.ARTIFACT, self.handle)

    def uploads_in_progress(self, peer_id: bytes) -> int:
        return self._uploads[peer_id]

    async def handle(self, stream: FramedStream) -> None:
        body = await stream.recv_frame(timeout=self.request_timeout)
        if body is None:
            return
        try:
            request = parse_request(body)
            if isinstance(request, ManifestRequest):
                artifact = self._artifact(request.root)
                reply = encode_manifest_reply(
                    artifact.manifest, len(artifact.metadata_blob), artifact.held_indices()
                )
                await stream.send_frame(reply)
            else:
                await self._upload(stream, request)
        except ArtifactRefusal as refusal:
            self.refusals[refusal.code_name] += 1
            log.debug("refused artifact request from %s: %s", short_id(stream.peer_id), refusal)
            await stream.send_frame(encode_refusal(refusal))

    def _artifact(self, root: bytes) -> HeldArtifact:
        artifact = self.holdings.get(root)
        if artifact is None:
            raise ArtifactRefusal(UNKNOWN_MODEL, "no model with this root is held here")
        return artifact

    async def _upload(self, stream: FramedStream, request: FetchRequest) -> None:
        artifact = self._artifact(request.root)
        if request.item is MetadataItem.BLOB:
            blob = artifact.metadata_blob
            item_nbytes = len(blob)
        else:
            index = request.item
            tensors = artifact.manifest.tensors
            if index >= len(tensors):
                raise ArtifactRefusal(BAD_REQUEST, f"tensor index {index} is outside the manifest")
            if index not in artifact.held_indices():
                raise ArtifactRefusal(NOT_HELD, f"tensor {tensors[index].name!r} is not held here")
            item_nbytes = tensors[index].nbytes
        offset, length = resolve_range(item_nbytes, request.offset, request.length)
        peer = stream.peer_id
        if self._uploads[peer] >= self.max_uploads_per_peer:
            raise ArtifactRefusal(OVERLOADED, f"{self.max_uploads_per_peer} uploads to this peer already")
        self._uploads[peer] += 1
        try:
            end, sent = offset + length, 0
            while offset < end:
                # Small chunks while paced keep each send's hold on the GIL short for the engine's
                # sake; an idle node sends the largest the protocol allows, for throughput.
                size = min(self.chunk_bytes if self.limiter.pacing else CHUNK_BYTES, end - offset)
                await self.limiter.acquire(size)
                if request.item is MetadataItem.BLOB:
                    data = blob[offset : offset + size]
                else:
                    data = artifact.read(request.item, offset, size)
                await stream.send_frame(encode_chunk(offset, data))
                offset += size
                sent += size
                self.uploaded_bytes += size
                self.uploaded_by_peer[peer] += size
            await stream.send_frame(encode_end(sent))
        finally:
            self._uploads[peer] -= 1
            if not self._uploads[peer]:
                del self._uploads[peer]


__all__ = ["DEFAULT_MAX_UPLOADS_PER_PEER", "ArtifactServer"]
