"""Give back the resident pages of a model file's mapping once llama.cpp has repacked its weights.

With weight repacking (engines.weight_repack: the CPU_REPACK or AMX buffer types), llama.cpp
reads each repacked tensor once through its mmap of the file and keeps its own copy; the
mapping stays, and with it every page it faulted in. A node then held its weights twice: on
Llama 3 8B's shape, a third of the model was 1.6 GiB mapped and 1.6 GiB repacked, 4.4 GiB
resident per node with the KV cache (bench/big_model.py), nearly three times the weights its
``--memory-budget`` placed. ``madvise(MADV_DONTNEED)`` on the mapping drops its pages from the
process; what llama.cpp still reads through it (norms, the token embedding's rows, tensors it
did not repack) faults back in from the page cache as it is used. The file and the page cache
are untouched: the kernel keeps or reclaims those pages like any file's.

No llama.cpp here: it reads ``/proc/self/maps`` and calls the C library's ``madvise``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
_PROC_MAPS = Path("/proc/self/maps")


def file_mappings(path: str | os.PathLike[str], maps_text: str) -> list[tuple[int, int]]:
    """The address ranges [start, end) of ``path``'s mappings in a ``/proc/<pid>/maps`` text."""
    target = os.path.realpath(path)
    ranges = []
    for line in maps_text.splitlines():
        # "7f..-7f.. r--s 00000000 08:01 1234    /path/to/file" (the path may hold spaces).
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, _, end = fields[0].partition("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def release_mapped_pages(path: str | os.PathLike[str], maps_path: Path = _PROC_MAPS) -> int:
    """Drop this process's resident pages of every mapping of ``path``; the bytes of address
    space advised (0 where there is no ``/proc`` or no ``madvise``)."""
    try:
        maps_text = maps_path.read_text()
    except OSError:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    released = 0
    for start, end in file_mappings(path, maps_text):
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
        else:
            log.debug("madvise(MADV_DONTNEED) on %s failed: errno %d", path, ctypes.get_errno())
    return released


__all__ = ["MADV_DONTNEED", "file_mappings", "release_mapped_pages"]
