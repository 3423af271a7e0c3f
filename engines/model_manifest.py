"""A model's identity by content, tensor by tensor: the manifest whose root is its fingerprint.

The fingerprint nodes compare (``model_artifact_digest``) was the SHA-256 of the whole
GGUF, so only a node holding the whole file could name the model, and nothing smaller
than the file could be checked. The manifest lists, in file order, one SHA-256 per
tensor (with the tensor's name, ggml type and shape), plus one digest of the file's
metadata records (every key/value record's encoded bytes, in file order, and the GGUF
version). Its root digests that list under a domain tag; two files with the same
metadata and tensors have the same root whatever their alignment padding, and a node
holding only some tensors (a slice, a transfer in progress) can still announce the
root and prove each tensor it holds (:meth:`ModelManifest.verify_tensor`).

Building one reads every tensor once, as hashing the whole file did; the result is
remembered by (path, size, mtime) in the cache, like file digests (:mod:`.file_digest`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engines.atomic_files import write_bytes_atomically
from engines.file_digest import file_identity, record_path
from engines.gguf_file import GGUFFile, GGUFFormatError, read_gguf

# What the root digests; a new layout of the manifest gets a new tag.
_ROOT_DOMAIN = b"meshnode/v1/model-manifest\0"
_RECORD_VERSION = 1
_BLOCK = 1 << 20


@dataclass(frozen=True)
class TensorDigest:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class ModelManifest:
    gguf_version: int
    # SHA-256 over the metadata records' encoded bytes, in file order.
    metadata_sha256: str
    tensors: tuple[TensorDigest, ...]

    @property
    def root(self) -> str:
        """The model fingerprint: SHA-256 (hex) over the domain tag, the metadata digest and every
        tensor's name, type, shape, size and digest, in file order (each field length-prefixed)."""
        digest = hashlib.sha256(_ROOT_DOMAIN)
        digest.update(self.gguf_version.to_bytes(4, "little"))
        digest.update(bytes.fromhex(self.metadata_sha256))
        digest.update(len(self.tensors).to_bytes(8, "little"))
        for tensor in self.tensors:
            name = tensor.name.encode()
            digest.update(len(name).to_bytes(4, "little") + name)
            digest.update(tensor.ggml_type.to_bytes(4, "little"))
            digest.update(len(tensor.shape).to_bytes(4, "little"))
            for dim in tensor.shape:
                digest.update(dim.to_bytes(8, "little"))
            digest.update(tensor.nbytes.to_bytes(8, "little"))
            digest.update(bytes.fromhex(tensor.sha256))
        return digest.hexdigest()

    def tensor(self, name: str) -> TensorDigest | None:
        return next((t for t in self.tensors if t.name == name), None)

    def verify_tensor(self, name: str, data: bytes | memoryview) -> bool:
        """Whether ``data`` is exactly the bytes of tensor ``name`` of this model."""
        expected = self.tensor(name)
        return (
            expected is not None
            and len(data) == expected.nbytes
            and hashlib.sha256(data).hexdigest() == expected.sha256
        )

    def to_json(self) -> dict[str, object]:
        return {
            "gguf_version": self.gguf_version,
            "metadata_sha256": self.metadata_sha256,
            "tensors": [[t.name, t.ggml_type, list(t.shape), t.nbytes, t.sha256] for t in self.tensors],
        }

    @classmethod
    def from_json(cls, record: object) -> ModelManifest:
        """The manifest ``to_json`` wrote; ValueError for anything else."""
        try:
            assert isinstance(record, dict)
            tensors = tuple(
                TensorDigest(str(name), int(kind), tuple(int(d) for d in shape), int(nbytes), _hex64(sha))
                for name, kind, shape, nbytes, sha in record["tensors"]
            )
            return cls(int(record["gguf_version"]), _hex64(record["metadata_sha256"]), tensors)
        except (AssertionError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a model manifest: {error}") from None


def _hex64(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64:
        raise ValueError("a digest is 64 hex characters")
    bytes.fromhex(value)
    return value


def build_manifest(path: Path, progress: Callable[[int], None] | None = None) -> ModelManifest:
    """Read ``path``'s header and hash each tensor's bytes; ``progress`` hears the bytes hashed."""
    gguf = read_gguf(path)
    metadata = hashlib.sha256()
    for record in gguf.metadata:
        metadata.update(record.raw)
    return ModelManifest(gguf.version, metadata.hexdigest(), _tensor_digests(gguf, progress))


def _tensor_digests(gguf: GGUFFile, progress: Callable[[int], None] | None) -> tuple[TensorDigest, ...]:
    digests = []
    with gguf.path.open("rb") as file:
        for info in gguf.tensors:
            file.seek(gguf.data_offset + info.offset)
            digest = hashlib.sha256()
            left = info.nbytes
            while left:
                block = file.read(min(_BLOCK, left))
                if not block:
                    raise GGUFFormatError(f"{gguf.path} ends inside tensor {info.name!r}")
                digest.update(block)
                left -= len(block)
                if progress is not None:
                    progress(len(block))
            digests.append(
                TensorDigest(info.name, info.ggml_type, info.shape, info.nbytes, digest.hexdigest())
            )
    return tuple(digests)


# ---------------------------------------------------------------------------- remembered manifests


def cached_manifest(
    path: Path, cache_dir: Path | None = None, progress: Callable[[int], None] | None = None
) -> ModelManifest:
    """:func:`build_manifest`, reusing the one recorded while the file's size and mtime are unchanged."""
    path = Path(path)
    remembered = record_path(path, cache_dir, "manifests")
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(remembered.read_text())
        if (
            isinstance(record, dict)
            and record.get("version") == _RECORD_VERSION
            and record.get("file") == file_identity(path)
        ):
            return ModelManifest.from_json(record.get("manifest"))
    manifest = build_manifest(path, progress)
    record = {"version": _RECORD_VERSION, "file": file_identity(path), "manifest": manifest.to_json()}
    # An unwritable cache costs a re-hash next time, nothing more.
    with contextlib.suppress(OSError):
        write_bytes_atomically(remembered, json.dumps(record).encode())
    return manifest


__all__ = ["ModelManifest", "TensorDigest", "build_manifest", "cached_manifest"]
