"""Room on disk for the tensors a node is about to fetch, checked before the first byte.

A fetch that runs a disk full fails on its last tensors after minutes of transfer, and
leaves the machine with no space for anything else on it (logs, other programs). So the
bytes still missing are compared with the free space first, keeping a reserve free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from meshnode.artifacts.store import StoreError
from meshnode.logs import mib

# Left free on the store's disk by any fetch: the node's logs and the rest of the machine need room.
DISK_RESERVE_BYTES = 128 * 2**20


class NoDiskRoom(StoreError):
    """The store's disk cannot take the tensors to fetch; the message says how much is needed."""


def check_disk_room(directory: Path, needed: int, *, what: str, reserve: int = DISK_RESERVE_BYTES) -> None:
    """Raises :class:`NoDiskRoom` unless ``directory``'s disk has ``needed`` bytes free beyond
    ``reserve``; ``what`` names what needs them ("layers [0, 9)")."""
    free = shutil.disk_usage(directory).free
    if needed + reserve > free:
        raise NoDiskRoom(
            f"{what} need {mib(needed)} more under {directory}, which has {mib(free)} free "
            f"({mib(reserve)} of it kept free): free space there, or choose another --model-store"
        )


__all__ = ["DISK_RESERVE_BYTES", "NoDiskRoom", "check_disk_room"]
