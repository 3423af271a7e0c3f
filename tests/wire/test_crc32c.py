"""CRC32C: meshnode's AVX2 + VPCLMULQDQ extension against google-crc32c, and the fallback path."""

from __future__ import annotations

import platform
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.wire import crc32c as crc_module
from meshnode.wire.crc32c import crc32c, google_crc32c_extend, simd_in_use

CHECK_INPUT = b"123456789"
CHECK_VALUE = 0xE3069283  # the catalogued CRC-32C check value

try:
    from meshnode.wire import _crc32c_simd
except ImportError:
    _crc32c_simd = None


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


SIMD_CPU = (
    platform.machine() in ("x86_64", "AMD64") and {"avx2", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= cpu_flags()
)
needs_simd = pytest.mark.skipif(
    _crc32c_simd is None or not _crc32c_simd.available, reason="the SIMD extension does not run here"
)


def reference(data: bytes, crc: int = 0) -> int:
    return google_crc32c.extend(crc, bytes(data))


@pytest.mark.skipif(not SIMD_CPU, reason="this CPU lacks AVX2 + VPCLMULQDQ")
def test_the_extension_is_built_and_used_where_the_cpu_has_the_instructions() -> None:
    # An install that silently fell back would checksum at two thirds of the speed.
    assert _crc32c_simd is not None, "meshnode.wire._crc32c_simd was not built (is gcc installed?)"
    assert _crc32c_simd.available
    assert simd_in_use()


def test_check_value() -> None:
    assert crc32c(CHECK_INPUT) == CHECK_VALUE
    assert google_crc32c_extend(CHECK_INPUT) == CHECK_VALUE


@needs_simd
@pytest.mark.parametrize(
    "size", [0, 1, 7, 8, 9, 223, 224, 447, 448, 449, 671, 672, 4096, 65535, 65536, 65537]
)
@pytest.mark.parametrize("offset", [0, 1, 5, 8, 31])
def test_simd_matches_google_at_region_boundaries(size: int, offset: int) -> None:
    # The kernel splits its input into three crc32 chains and a folded region in steps of
    # 224 bytes and keeps the GIL below 64 KiB: sizes around those edges, unaligned starts.
    buffer = np.random.default_rng(size * 64 + offset).bytes(size + offset)
    view = memoryview(buffer)[offset:]
    assert _crc32c_simd.extend(0, view) == reference(view)
    assert _crc32c_simd.extend(0x1234ABCD, view) == reference(view, 0x1234ABCD)


@needs_simd
def test_simd_matches_google_on_large_inputs() -> None:
    rng = np.random.default_rng(1)
    for size in (1 << 20, (1 << 20) + 13, 8 * 1024 * 1024 + 1):
        data = rng.bytes(size)
        assert _crc32c_simd.extend(7, data) == reference(data, 7)


@given(data=st.binary(max_size=3000), split=st.integers(0, 3000), start=st.integers(0, 2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_any_input_any_split_matches_google(data: bytes, split: int, start: int) -> None:
    split = min(split, len(data))
    whole = crc32c(data, start)
    assert whole == reference(data, start)
    # Continuing from a partial checksum equals checksumming at once.
    assert crc32c(memoryview(data)[split:], crc32c(data[:split], start)) == whole


def test_every_buffer_kind_is_read_in_place() -> None:
    data = np.random.default_rng(2).bytes(300_000)
    expected = reference(data)
    for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert crc32c(buffer) == expected  # type: ignore[arg-type]  # numpy arrays are buffers too; the alias names the built-in ones


def test_the_fallback_matches_when_the_extension_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crc_module, "_SIMD", None)  # as if the extension had not been built
    assert not crc_module.simd_in_use()
    data = np.random.default_rng(3).bytes(1 << 19)
    assert crc_module.crc32c(memoryview(data)[3:]) == reference(data[3:])
    assert crc_module.crc32c(data[:100]) == reference(data[:100])
