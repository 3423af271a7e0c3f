"""CRC32C (Castagnoli) over any buffer, without copying it.

On x86-64 CPUs with AVX2 and VPCLMULQDQ, meshnode's own extension
(``_crc32c_simd.c``) checksums at about memcpy speed, 1.6x google-crc32c, and reads
any buffer in place.

Elsewhere google-crc32c does the work. Its Python wrapper only accepts ``bytes``
objects (its C code parses ``y#``), so checksumming a slice of a received frame
would first copy the slice. The hardware-accelerated C library the wheel bundles
exports ``crc32c_extend(crc, data, length)``; calling it on the buffer's address
keeps verification zero-copy. Where that library cannot be located the Python API
is used with a copy — same result, slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

try:
    # A C extension setup.py builds where it can (no type stub: imported by name).
    _crc32c_simd: Any = importlib.import_module("meshnode.wire._crc32c_simd")
except ImportError:  # not built: no compiler at install time, or not x86-64
    _crc32c_simd = None

Buffer = bytes | bytearray | memoryview

_SIMD = _crc32c_simd if _crc32c_simd is not None and _crc32c_simd.available else None


def _load_library() -> ctypes.CDLL | None:
    package_dir = Path(google_crc32c.__file__).resolve().parent
    candidates = sorted((package_dir.parent / "google_crc32c.libs").glob("libcrc32c*"))
    system = ctypes.util.find_library("crc32c")
    if system:
        candidates.append(Path(system))
    for candidate in candidates:
        try:
            library = ctypes.CDLL(str(candidate))
            extend = library.crc32c_extend
        except (OSError, AttributeError):
            continue
        extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        extend.restype = ctypes.c_uint32
        return library
    return None


_LIBRARY = _load_library()


# Below this size copying into ``bytes`` for the Python API is cheaper than
# the ctypes call and the buffer-address lookup.
_DIRECT_CALL_MIN_BYTES = 256 * 1024


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``crc`` (0 starts a new checksum)."""
    if _SIMD is not None:
        return _SIMD.extend(crc, data)
    return google_crc32c_extend(data, crc)


def simd_in_use() -> bool:
    """Whether checksums run on meshnode's AVX2 + VPCLMULQDQ extension."""
    return _SIMD is not None


def simd_built() -> bool:
    """Whether the extension was compiled at install time (it may still not suit this CPU)."""
    return _crc32c_simd is not None


def google_crc32c_extend(data: Buffer, crc: int = 0) -> int:
    """CRC32C through google-crc32c (the path used where the extension is unavailable)."""
    if type(data) is bytes:
        return google_crc32c.extend(crc, data)
    if _LIBRARY is None or len(data) < _DIRECT_CALL_MIN_BYTES:
        return google_crc32c.extend(crc, bytes(data))
    view = np.frombuffer(data, dtype=np.uint8)
    return int(_LIBRARY.crc32c_extend(crc, view.ctypes.data, view.size))
