"""Where fetched tensors land: a sparse GGUF per model, and a journal of the verified ones.

``<store_dir>/<root>/model.gguf`` gets the model's whole header at once (metadata from
the verified blob, tensor infos from the verified manifest, canonical offsets) and is
truncated to its full size, so unfetched tensors are holes that cost no disk. The file
parses with :func:`engines.gguf_file.read_gguf` from the start, and the slicing code
reads whatever tensors are in it.

A tensor is streamed to its place in bounded chunks while it is hashed
(:class:`TensorWriter`); only when the digest matches the manifest are its bytes
fsync'd and then its name appended to ``journal`` and the journal fsync'd. That
order is the crash rule: after a SIGKILL (or a power cut) a journaled tensor's bytes
are on disk, and reopening trusts the journal and nothing else, so a tensor cut off
mid-write is simply fetched again. A torn last journal line is ignored and cut away.
Several tensors verified at about the same time may be committed together
(:meth:`PartialModel.commit_verified`): one fsync of the file for all their bytes, then
their lines, then one fsync of the journal; the rule holds for each of them.

A tensor cut off by its source (the link failed, the fetch was stopped) keeps what
arrived: its bytes are fsync'd and ``unfinished.json`` records how many there are,
so the next attempt, from any source and in any later run, asks only for the rest.
Nothing of those bytes is trusted until the whole tensor's digest matches; the
bytes already there are hashed again from disk when the tensor is resumed. A
SIGKILL mid-tensor loses only what arrived since the last such record.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path

from engines.atomic_files import write_bytes_atomically
from engines.model_manifest import ModelManifest, TensorDigest
from meshnode.artifacts.gguf_layout import GGUFLayout, canonical_layout

MODEL_FILE = "model.gguf"
JOURNAL_FILE = "journal"
# The verified manifest and metadata blob, kept so a restarted node resumes without asking a peer.
MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.bin"
# Tensors cut off mid-way: how many of their bytes are on disk (fsync'd), to resume from there.
UNFINISHED_FILE = "unfinished.json"
# Resumed bytes are hashed again from disk in blocks of this size.
_REHASH_BLOCK_BYTES = 4 << 20
# Held (flock) by the one process that writes the store.
LOCK_FILE = ".lock"


class StoreError(Exception):
    """The store cannot hold this model (bad metadata, or a file it cannot write)."""


class TensorDigestMismatch(StoreError):
    """The bytes written for a tensor are not the manifest's: nothing of them is trusted."""

    def __init__(self, name: str) -> None:
        super().__init__(f"tensor {name!r} does not match its manifest digest")
        self.name = name


class StoreInUse(StoreError):
    """Another process holds the store: two writers would replace each other's files mid-fetch."""


class ArtifactStore:
    def __init__(self, store_dir: Path) -> None:
        self.store_dir = Path(store_dir)
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take the store for this process; raises :class:`StoreInUse` when another holds it.

        Two nodes on one store would each create a model's sparse file and write tensors into
        whichever inode they opened, while the journal both append to vouches for them all:
        a node could then load holes as weights.
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.store_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreInUse(
                f"another meshnode uses the model store {self.store_dir}; "
                "give each node its own --model-store (the default is <data-dir>/models)"
            ) from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def open(self, manifest: ModelManifest, metadata_blob: bytes) -> PartialModel:
        """The partial model for ``manifest`` (created on first use, resumed after that).

        ``metadata_blob`` must already be verified against ``manifest.metadata_sha256``;
        a blob that does not do so is refused here too.
        """
        if hashlib.sha256(metadata_blob).hexdigest() != manifest.metadata_sha256:
            raise StoreError("metadata blob does not match the manifest's metadata digest")
        try:
            layout = canonical_layout(manifest, metadata_blob)
        except ValueError as error:
            raise StoreError(f"metadata cannot be laid out: {error}") from None
        directory = self.store_dir / manifest.root
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / MANIFEST_FILE).exists():
            write_bytes_atomically(directory / METADATA_FILE, metadata_blob)
            write_bytes_atomically(directory / MANIFEST_FILE, json.dumps(manifest.to_json()).encode())
        return PartialModel(directory, manifest, metadata_blob, layout)

    def reopen(self, root: str) -> PartialModel | None:
        """The partial model of ``root`` (hex) as a previous run left it, or ``None`` when there
        is none whose saved manifest still hashes to ``root``."""
        directory = self.store_dir / root
        try:
            manifest = ModelManifest.from_json(json.loads((directory / MANIFEST_FILE).read_bytes()))
            blob = (directory / METADATA_FILE).read_bytes()
        except (OSError, ValueError):
            return None
        if manifest.root != root:
            return None
        try:
            return self.open(manifest, blob)
        except StoreError:
            return None


class PartialModel:
    """One model's sparse GGUF and its journal. Use :meth:`ArtifactStore.open` to get one."""

    def __init__(self, directory: Path, manifest: ModelManifest, metadata_blob: bytes, layout: GGUFLayout):
        self.directory = directory
        self.manifest = manifest
        self.metadata_blob = metadata_blob
        self.layout = layout
        self._index = {t.name: i for i, t in enumerate(manifest.tensors)}
        directory.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        # name -> bytes of it on disk, for tensors cut off mid-way (UNFINISHED_FILE).
        self._unfinished: dict[str, int] = {}
        # Commits run in worker threads (fsync blocks); journal lines must not interleave.
        self._journal_lock = threading.Lock()
        self._unfinished_lock = threading.Lock()
        fresh = not self._header_matches()
        if fresh:
            # A new model, or a header from another layout: nothing in the old file is trusted.
            for stale in (self.journal_path, self._unfinished_path):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            self._create_file()
        else:
            self._verified = self._read_journal()
            self._unfinished = self._read_unfinished()
        self._fd = os.open(self.path, os.O_RDWR)
        self._journal = open(self.journal_path, "ab")  # noqa: SIM115 -- lives as long as the model

    @property
    def path(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def journal_path(self) -> Path:
        return self.directory / JOURNAL_FILE

    @property
    def verified(self) -> frozenset[str]:
        return frozenset(self._verified)

    @property
    def verified_indices(self) -> frozenset[int]:
        return frozenset(self._index[name] for name in self._verified)

    def index_of(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the manifest") from None

    def missing(self, names: list[str] | tuple[str, ...] | frozenset[str]) -> tuple[str, ...]:
        """Those of ``names`` not verified yet, in file order; KeyError for a name not in the model."""
        wanted = {self.index_of(name) for name in names}
        return tuple(
            self.manifest.tensors[i].name
            for i in sorted(wanted)
            if self.manifest.tensors[i].name not in self._verified
        )

    def bytes_on_disk(self) -> int:
        """Disk space the sparse file and the journal take (allocated blocks, holes excluded)."""
        total = 0
        for path in (self.path, self.journal_path):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
        return total

    def tensor_offset(self, index: int) -> int:
        """Absolute file offset of tensor ``index``'s bytes."""
        return self.layout.tensor_offsets[index]

    def read(self, index: int, offset: int, length: int) -> bytes:
        """``length`` bytes of tensor ``index`` from ``offset`` (for uploading a verified tensor)."""
        return os.pread(self._fd, length, self.tensor_offset(index) + offset)

    def writer(self, name: str) -> TensorWriter:
        """A writer for tensor ``name``'s bytes to its end: from where an earlier attempt was cut
        off (:meth:`keep`), whose bytes it hashes again from disk first, else from its start."""
        index = self.index_of(name)
        writer = TensorWriter(self, self.manifest.tensors[index], self.tensor_offset(index))
        resumed = self._unfinished.get(name, 0)
        if resumed:
            writer.rehash(resumed)
        return writer

    def unfinished_bytes(self, name: str) -> int:
        """Bytes of tensor ``name`` on disk from an attempt that was cut off (0: none)."""
        return self._unfinished.get(name, 0)

    def keep(self, writer: TensorWriter) -> None:
        """Keep what ``writer`` wrote of a tensor whose source stopped mid-way, for the next
        attempt (from any source, in this run or a later one) to go on from."""
        name = writer.tensor.name
        if name in self._verified or writer.written == self._unfinished.get(name, 0):
            return
        os.fsync(self._fd)  # the bytes first, then the record that counts them
        self._record_unfinished(name, writer.written)

    def commit_verified(self, writers: list[TensorWriter] | tuple[TensorWriter, ...]) -> None:
        """Journal the tensors of ``writers``, each of which must match its digest
        (:class:`TensorDigestMismatch` before anything is written if one does not): the file's
        bytes made durable once for all of them, then their journal lines, then the journal."""
        for writer in writers:
            writer.verify()
        self._commit([writer.tensor for writer in writers])

    def discard(self, name: str) -> None:
        """Trust nothing of tensor ``name``'s unfinished bytes: the next attempt starts over."""
        self._record_unfinished(name, 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._journal.close()

    def __enter__(self) -> PartialModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------

    def _header_matches(self) -> bool:
        header = self.layout.header
        try:
            with self.path.open("rb") as file:
                size = os.fstat(file.fileno()).st_size
                return size == self.layout.file_size and file.read(len(header)) == header
        except FileNotFoundError:
            return False

    def _create_file(self) -> None:
        temporary = self.path.with_name(f".{MODEL_FILE}.tmp")
        with temporary.open("wb") as file:
            file.write(self.layout.header)
            file.write(bytes(self.layout.data_offset - len(self.layout.header)))
            # Holes for every tensor: the file has its full size and costs only its header.
            file.truncate(self.layout.file_size)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)
        _fsync_directory(self.directory)

    def _read_journal(self) -> set[str]:
        try:
            data = self.journal_path.read_bytes()
        except FileNotFoundError:
            return set()
        verified: set[str] = set()
        complete = data.rfind(b"\n") + 1
        for line in data[:complete].splitlines():
            entry = _parse_journal_line(line, self.manifest)
            if entry is not None:
                verified.add(entry)
        if complete != len(data):
            # A line torn by a crash: cut it so the next entry starts on a line of its own.
            with self.journal_path.open("r+b") as journal:
                journal.truncate(complete)
                os.fsync(journal.fileno())
        return verified

    def _commit(self, tensors: list[TensorDigest]) -> None:
        os.fsync(self._fd)  # the bytes first, then the journal lines that vouch for them
        lines = b"".join(
            f"{self._index[tensor.name]}\t{tensor.sha256}\t{tensor.name}\n".encode() for tensor in tensors
        )
        with self._journal_lock:
            self._journal.write(lines)
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._verified.update(tensor.name for tensor in tensors)
        for tensor in tensors:
            self._record_unfinished(tensor.name, 0)

    @property
    def _unfinished_path(self) -> Path:
        return self.directory / UNFINISHED_FILE

    def _read_unfinished(self) -> dict[str, int]:
        """The record of cut-off tensors, each checked against this manifest (name, digest, a size
        short of the tensor's); anything else in it is ignored."""
        try:
            entries = json.loads(self._unfinished_path.read_bytes())
        except (OSError, ValueError):
            return {}
        kept: dict[str, int] = {}
        for entry in entries if isinstance(entries, list) else []:
            try:
                name, sha256, nbytes = entry["name"], entry["sha256"], entry["bytes"]
                tensor = self.manifest.tensors[self._index[name]]
            except (KeyError, TypeError):
                continue
            resumable = isinstance(nbytes, int) and 0 < nbytes < tensor.nbytes
            if tensor.sha256 == sha256 and resumable and name not in self._verified:
                kept[name] = nbytes
        return kept

    def _record_unfinished(self, name: str, nbytes: int) -> None:
        """``nbytes`` of tensor ``name`` are on disk (0: none to resume from), recorded on disk."""
        # Commits run in worker threads, keep and discard in the event loop's.
        with self._unfinished_lock:
            if nbytes and name not in self._verified:
                self._unfinished[name] = nbytes
            elif self._unfinished.pop(name, None) is None:
                return
            entries = [
                {"name": name, "sha256": self.manifest.tensors[self._index[name]].sha256, "bytes": nbytes}
                for name, nbytes in sorted(self._unfinished.items())
            ]
            write_bytes_atomically(self._unfinished_path, json.dumps(entries).encode())


def _parse_journal_line(line: bytes, manifest: ModelManifest) -> str | None:
    """The tensor a journal line vouches for, if it names one of this manifest exactly."""
    try:
        index_text, sha256, name = line.decode().split("\t", 2)
        index = int(index_text)
    except ValueError:
        return None
    if not 0 <= index < len(manifest.tensors):
        return None
    tensor = manifest.tensors[index]
    return name if (tensor.name, tensor.sha256) == (name, sha256) else None


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TensorWriter:
    """Writes one tensor's bytes in order, hashing as it goes; :meth:`commit` verifies and journals.

    Memory stays bounded by the chunk a caller passes: nothing of the tensor is kept.
    """

    def __init__(self, model: PartialModel, tensor: TensorDigest, file_offset: int) -> None:
        self._model = model
        self.tensor = tensor
        self._file_offset = file_offset
        self._digest = hashlib.sha256()
        self.written = 0
        # Bytes an earlier attempt wrote, taken as they are on disk (0: this writer wrote all).
        self.resumed = 0

    def rehash(self, nbytes: int) -> None:
        """Take the tensor's first ``nbytes`` as they are on disk and go on after them."""
        while self.written < nbytes:
            block = os.pread(
                self._model._fd,
                min(_REHASH_BLOCK_BYTES, nbytes - self.written),
                self._file_offset + self.written,
            )
            if not block:
                raise StoreError(f"{self._model.path} ends inside tensor {self.tensor.name!r}")
            self._digest.update(block)
            self.written += len(block)
        self.resumed = nbytes

    def write(self, data: bytes | memoryview) -> None:
        if self.written + len(data) > self.tensor.nbytes:
            raise TensorDigestMismatch(self.tensor.name)
        os.pwrite(self._model._fd, data, self._file_offset + self.written)
        self._digest.update(data)
        self.written += len(data)

    def verify(self) -> None:
        """:class:`TensorDigestMismatch` unless every byte of the tensor was written and they are
        the manifest's (nothing is written: a commit makes them durable and journals them)."""
        if self.written != self.tensor.nbytes or self._digest.hexdigest() != self.tensor.sha256:
            raise TensorDigestMismatch(self.tensor.name)

    def commit(self) -> None:
        """Journal the tensor if its bytes are the manifest's; :class:`TensorDigestMismatch` if not
        (the bytes stay unjournaled, so they are never trusted and a refetch overwrites them)."""
        self._model.commit_verified([self])


__all__ = ["ArtifactStore", "PartialModel", "StoreError", "TensorDigestMismatch", "TensorWriter"]
