"""SHA-256 of large files, remembered by (path, size, mtime) so a restart does not re-hash them."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from engines.atomic_files import write_bytes_atomically
from engines.cache import cache_root

_BLOCK = 1 << 20


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(_BLOCK):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def record_path(path: Path, cache_dir: Path | None, kind: str = "digests") -> Path:
    """Where what is remembered of ``path`` (its ``kind``: digests, manifests) lives in the cache."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return (cache_dir or cache_root()) / kind / f"{key}.json"


def file_identity(path: Path) -> dict[str, object]:
    """The file version a remembered record is valid for: its path, size and mtime."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def remembered_sha256(path: Path, cache_dir: Path | None = None) -> str | None:
    """The digest recorded for this exact file version, or ``None``."""
    try:
        record = json.loads(record_path(path, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or {
        k: record.get(k) for k in ("path", "size", "mtime_ns")
    } != file_identity(path):
        return None
    digest = record.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def remember_sha256(path: Path, digest: str, cache_dir: Path | None = None) -> None:
    record = {**file_identity(path), "sha256": digest}
    write_bytes_atomically(record_path(path, cache_dir), json.dumps(record).encode())


def cached_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """``sha256_file`` that reuses the recorded digest while the file's size and mtime are unchanged."""
    path = Path(path)
    if (known := remembered_sha256(path, cache_dir)) is not None:
        return known
    digest = sha256_file(path)
    # An unwritable cache costs a re-hash next time, nothing more.
    with contextlib.suppress(OSError):
        remember_sha256(path, digest, cache_dir)
    return digest
