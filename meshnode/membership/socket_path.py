"""A Unix socket path that fits ``sun_path`` however deep the data directory lies.

Linux allows 107 bytes for a socket's path, and a data directory under a long home or
project path passes that: the node could not make its status socket, and ``meshnode
status`` and ``invite`` then said no node was running. A path through an open descriptor
of the directory (``/proc/self/fd/N/name``) reaches the same file in a few bytes, and the
directory's own permissions still guard it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# sun_path is 108 bytes on Linux, with its terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


@contextlib.contextmanager
def reachable_socket_path(path: Path) -> Iterator[str]:
    """``path`` itself where it fits, else a short alias valid until the block ends (long
    enough to bind or connect: the socket stays reachable at ``path`` afterwards)."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES or not Path("/proc/self/fd").is_dir():
        yield str(path)
        return
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


__all__ = ["MAX_SOCKET_PATH_BYTES", "reachable_socket_path"]
