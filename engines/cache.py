"""Where derived artifacts live, and how they are written without ever leaving half a file."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV_VAR = "MESHNODE_CACHE_DIR"


def cache_root() -> Path:
    """``$MESHNODE_CACHE_DIR`` or ``~/.cache/meshnode``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured) if configured else Path.home() / ".cache" / "meshnode"


@contextlib.contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``destination`` and rename it into place on success.

    A crash or an exception leaves either the old file or no file, never a partial one;
    concurrent writers each rename a complete file, and the last one wins.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield temporary
        os.replace(temporary, destination)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def write_bytes_atomically(destination: Path, data: bytes) -> None:
    with atomic_path(destination) as temporary:
        temporary.write_bytes(data)
