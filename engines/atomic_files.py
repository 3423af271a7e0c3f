"""Files written without ever leaving half of one: the model cache's and the model store's.

Both the engines' derived files (:mod:`engines.cache`) and the mesh's fetched tensors
(``meshnode.artifacts.store``) are written this way. It sits with the model files at the foot of
the layer contract (pyproject.toml), which any layer may use and which imports nothing of an
engine or of the mesh.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


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


__all__ = ["atomic_path", "write_bytes_atomically"]
