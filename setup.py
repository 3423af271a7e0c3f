"""Declares meshnode's one C extension; everything else about the package is in pyproject.toml.

CRC32C at about memcpy speed on x86-64 with AVX2 + VPCLMULQDQ (meshnode/wire/crc32c.py).
It is optional: where it does not build, google-crc32c does the work.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("meshnode.wire._crc32c_simd", ["meshnode/wire/_crc32c_simd.c"], optional=True),
    ]
)
