"""What this node can upload, by model root: a whole GGUF it serves, or a model it is fetching.

A full file (a node started with ``--model``) holds every tensor; a
:class:`~meshnode.artifacts.store.PartialModel` holds its journaled tensors only, and
that set grows while the fetch runs, so :meth:`HeldArtifact.held_indices` is asked on
every request.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

from engines.gguf_file import read_gguf
from engines.model_manifest import ModelManifest, cached_manifest
from meshnode.artifacts.store import PartialModel


class HeldArtifact(Protocol):
    """A model this node uploads from."""

    @property
    def manifest(self) -> ModelManifest: ...

    @property
    def metadata_blob(self) -> bytes: ...

    def held_indices(self) -> frozenset[int]: ...

    def read(self, index: int, offset: int, length: int) -> bytes:
        """``length`` bytes of tensor ``index`` from ``offset``; only for a held index."""
        ...


class FullModel:
    """A whole GGUF on disk: every tensor is held."""

    def __init__(self, path: Path, manifest: ModelManifest | None = None, cache_dir: Path | None = None):
        self.path = Path(path)
        gguf = read_gguf(self.path)
        self.manifest = manifest or cached_manifest(self.path, cache_dir)
        if tuple(t.name for t in gguf.tensors) != tuple(t.name for t in self.manifest.tensors):
            raise ValueError(f"{self.path}'s tensors are not the manifest's")
        self.metadata_blob = b"".join(record.raw for record in gguf.metadata)
        if hashlib.sha256(self.metadata_blob).hexdigest() != self.manifest.metadata_sha256:
            raise ValueError(f"{self.path}'s metadata is not the manifest's")
        self._offsets = tuple(gguf.data_offset + t.offset for t in gguf.tensors)
        self._all = frozenset(range(len(self._offsets)))
        self._fd = os.open(self.path, os.O_RDONLY)

    def held_indices(self) -> frozenset[int]:
        return self._all

    def read(self, index: int, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, self._offsets[index] + offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PartialHolding:
    """A :class:`PartialModel` as an upload source: its journaled tensors."""

    def __init__(self, partial: PartialModel) -> None:
        self.partial = partial

    @property
    def manifest(self) -> ModelManifest:
        return self.partial.manifest

    @property
    def metadata_blob(self) -> bytes:
        return self.partial.metadata_blob

    def held_indices(self) -> frozenset[int]:
        return self.partial.verified_indices

    def read(self, index: int, offset: int, length: int) -> bytes:
        return self.partial.read(index, offset, length)


class Holdings:
    """The models this node uploads, by root (32 bytes)."""

    def __init__(self) -> None:
        self._by_root: dict[bytes, HeldArtifact] = {}

    def add(self, artifact: HeldArtifact) -> bytes:
        """Serve ``artifact``; returns its root. A later add of the same root replaces it
        (a finished fetch handing over to the full file, say)."""
        root = bytes.fromhex(artifact.manifest.root)
        self._by_root[root] = artifact
        return root

    def get(self, root: bytes) -> HeldArtifact | None:
        return self._by_root.get(root)


__all__ = ["FullModel", "HeldArtifact", "Holdings", "PartialHolding"]
