"""Declares meshnode's C extensions; everything else about the package is in pyproject.toml.

Both are optional: where one does not build, a slower path does the same work.

- CRC32C at about memcpy speed on x86-64 with AVX2 + VPCLMULQDQ (meshnode/wire/crc32c.py);
  otherwise google-crc32c.
- The eval callback that copies a non-tail shard's hidden rows out of llama.cpp without
  the GIL (engines/hidden_capture.py); otherwise a Python callback.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("meshnode.wire._crc32c_simd", ["meshnode/wire/_crc32c_simd.c"], optional=True),
        Extension("engines._hidden_capture", ["engines/_hidden_capture.c"], optional=True),
    ]
)
