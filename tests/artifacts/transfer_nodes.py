"""Real nodes over real QUIC serving the tiny model's artifacts, and a holding that lies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.mesh_nodes import start_first_node, start_joiner
from helpers.polling import eventually

from engines.gguf_file import read_gguf
from engines.slicing import tensors_for_range
from engines.tiny_model import ensure_tiny_model
from meshnode.artifacts.holdings import HeldArtifact, Holdings
from meshnode.artifacts.server import ArtifactServer
from meshnode.artifacts.upload_limit import UploadLimiter
from meshnode.node import Node


class FlippingHolding:
    """A holding that serves another's bytes with one bit flipped in every tensor."""

    def __init__(self, honest: HeldArtifact) -> None:
        self.honest = honest
        self.manifest = honest.manifest
        self.metadata_blob = honest.metadata_blob

    def held_indices(self) -> frozenset[int]:
        return self.honest.held_indices()

    def read(self, index: int, offset: int, length: int) -> bytes:
        data = bytearray(self.honest.read(index, offset, length))
        if offset == 0:
            data[0] ^= 0x01
        return bytes(data)


class LyingMetadata:
    """A holding whose metadata blob has its first byte changed (the digest no longer matches)."""

    def __init__(self, honest: HeldArtifact) -> None:
        self.honest = honest
        self.manifest = honest.manifest
        self.metadata_blob = b"\x00" + honest.metadata_blob[1:]

    def held_indices(self) -> frozenset[int]:
        return self.honest.held_indices()

    def read(self, index: int, offset: int, length: int) -> bytes:
        return self.honest.read(index, offset, length)


class DisconnectingHolding:
    """A holding whose node goes away (shuts down) in the middle of its first upload."""

    def __init__(self, honest: HeldArtifact, node: Node) -> None:
        self.honest = honest
        self.node = node
        self.manifest = honest.manifest
        self.metadata_blob = honest.metadata_blob
        self.shutdown: asyncio.Task[None] | None = None

    def held_indices(self) -> frozenset[int]:
        return self.honest.held_indices()

    def read(self, index: int, offset: int, length: int) -> bytes:
        if self.shutdown is None:
            self.shutdown = asyncio.get_running_loop().create_task(self.node.shutdown())
        return self.honest.read(index, offset, length)


class CuttingHolding:
    """Uploads tensor ``index`` up to byte ``cut`` the first time it is asked, then fails that
    upload (its stream ends with an error, as when the source's disk or link gives out)."""

    def __init__(self, honest: HeldArtifact, index: int, cut: int) -> None:
        self.honest = honest
        self.manifest = honest.manifest
        self.metadata_blob = honest.metadata_blob
        self.index = index
        self.cut = cut
        self.has_cut = False

    def held_indices(self) -> frozenset[int]:
        return self.honest.held_indices()

    def read(self, index: int, offset: int, length: int) -> bytes:
        if index == self.index and offset + length > self.cut and not self.has_cut:
            self.has_cut = True
            raise OSError("this source's disk gave out")
        return self.honest.read(index, offset, length)


@dataclass
class Peer:
    node: Node
    server: ArtifactServer

    @property
    def id(self) -> bytes:
        return self.node.node_id


def serve(node: Node, *artifacts: HeldArtifact, limiter: UploadLimiter | None = None, **options: Any) -> Peer:
    holdings = Holdings()
    for artifact in artifacts:
        holdings.add(artifact)
    server = ArtifactServer(holdings, limiter or UploadLimiter(bytes_per_s=0), **options)
    server.register(node)
    return Peer(node, server)


@contextlib.asynccontextmanager
async def mesh_of(
    tmp_path: Path, count: int, listen: Callable[[], str] | None = None
) -> AsyncIterator[list[Node]]:
    """``count`` started nodes in one mesh, each seeing every other; each listening at ``listen()``
    when given (default: a free UDP port on loopback)."""

    def config() -> dict[str, Any]:
        return {} if listen is None else {"listen": listen()}

    first = await start_first_node(tmp_path, **config())
    nodes = [first]
    try:
        for index in range(1, count):
            nodes.append(await start_joiner(tmp_path, f"node{index}", first, **config()))
        await eventually(
            lambda: all(
                other.node_id in node.state.table for node in nodes for other in nodes if other is not node
            ),
            what="every node sees every other",
        )
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.shutdown()


# The tensor a cutting source fails mid-way in the resume tests.
CUT_TENSOR = "token_embd.weight"


# A source sending 4 KiB chunks paced well below what the joiner reads, so that the joiner has
# read what was sent before the source's stream fails (a reset drops what is still unread).
def paced() -> dict:
    return {"chunk_bytes": 4096, "limiter": UploadLimiter(bytes_per_s=256 * 1024)}


def head_range(manifest, layers: int) -> list[str]:
    """What a first-range shard of ``layers`` layers needs (engines.slicing's roles), in file order."""
    needed = tensors_for_range(read_gguf(ensure_tiny_model()), 0, layers)
    return [tensor.name for tensor in manifest.tensors if tensor.name in needed]


def nbytes(manifest, names) -> int:
    return sum(manifest.tensor(name).nbytes for name in names)
