"""Whether llama-cpp-python's libraries carry a C++ runtime of their own, and what to do then.

A compiler set up to link ``libstdc++`` statically (PyTorch's CUDA images ship one as
``/opt/gcc/bin/g++``) builds a ``libllama.so`` and ``libggml-*.so`` that each hold a private copy
of the C++ runtime and export it. Once anything else in the process loads the system's
``libstdc++.so.6`` (numpy, yaml and most C++ extensions do), llama.cpp's calls bind partly to one
copy and partly to another, and the first ``std::ostream`` it formats into while loading a model
(``llama_model::print_info``) dies of SIGSEGV: every model load, on CPU and GPU alike (found on
the H100 device machine, bench/RESULTS.md). Preloading the system runtime makes every library bind
to that one copy; rebuilding with a compiler that links it dynamically removes the copies.

Only the ELF dynamic section is read (``DT_NEEDED``), so this costs microseconds and loads nothing.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_SHT_DYNAMIC = 6
_DT_NULL = 0
_DT_NEEDED = 1
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")
_DYNAMIC_ENTRY = struct.Struct("<qQ")
# A shared library's name table is small; a larger one is not a library this reads.
_MAX_DYNAMIC_BYTES = 1 << 20
_CXX_RUNTIMES = ("libstdc++.so", "libc++.so")
PRELOAD_LIBRARY = "libstdc++.so.6"
PRELOAD_FIX = f"LD_PRELOAD={PRELOAD_LIBRARY}"


def elf_needed(path: Path) -> tuple[str, ...] | None:
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF file; None for anything else
    (another format, a truncated or odd file)."""
    try:
        with path.open("rb") as handle:
            header = handle.read(64)
            if len(header) < 64 or header[:4] != _ELF_MAGIC:
                return None
            if header[4] != _ELFCLASS64 or header[5] != _ELFDATA2LSB:
                return None
            (section_offset,) = struct.unpack_from("<Q", header, 0x28)
            entry_size, count = struct.unpack_from("<HH", header, 0x3A)
            if entry_size != _SECTION_HEADER.size or count == 0:
                return None
            handle.seek(section_offset)
            table = handle.read(entry_size * count)
            if len(table) < entry_size * count:
                return None
            sections = [_SECTION_HEADER.unpack_from(table, i * entry_size) for i in range(count)]
            dynamic = next((s for s in sections if s[1] == _SHT_DYNAMIC), None)
            if dynamic is None:
                return ()
            _, _, _, _, offset, size, link, _, _, _ = dynamic
            if size > _MAX_DYNAMIC_BYTES or link >= count:
                return None
            strings_offset, strings_size = sections[link][4], sections[link][5]
            if strings_size > _MAX_DYNAMIC_BYTES:
                return None
            handle.seek(offset)
            entries = handle.read(size)
            handle.seek(strings_offset)
            strings = handle.read(strings_size)
    except OSError:
        return None
    names = []
    for start in range(0, len(entries) - _DYNAMIC_ENTRY.size + 1, _DYNAMIC_ENTRY.size):
        tag, value = _DYNAMIC_ENTRY.unpack_from(entries, start)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED and value < len(strings):
            end = strings.find(b"\0", value)
            names.append(strings[value : end if end >= 0 else len(strings)].decode("utf-8", "replace"))
    return tuple(names)


LIBRARY_PATH_ENV = "LLAMA_CPP_LIB_PATH"


def llama_library_dir() -> Path:
    """The folder llama-cpp-python loads ``libllama`` from: its own ``lib/``, or the one
    ``LLAMA_CPP_LIB_PATH`` names. llama-cpp-python reads that once, on import; it is set
    before a node starts and its probe children inherit it, so reading it now agrees."""
    import llama_cpp

    override = os.environ.get(LIBRARY_PATH_ENV)
    return Path(override) if override else Path(llama_cpp.__file__).parent / "lib"


def bundled_cxx_runtime(library_dir: Path | None = None) -> Path | None:
    """``libllama.so`` when it is an ELF library that needs no shared C++ runtime, i.e. carries
    its own copy; None when it links one dynamically, or cannot be read (another platform)."""
    directory = llama_library_dir() if library_dir is None else library_dir
    library = directory / "libllama.so"
    needed = elf_needed(library)
    if not needed:
        return None
    if any(name.startswith(_CXX_RUNTIMES) for name in needed):
        return None
    return library


def preloaded_environment() -> dict[str, str]:
    """``LD_PRELOAD`` with the system's C++ runtime first, for a child process to try."""
    current = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": PRELOAD_LIBRARY + (":" + current if current else "")}


def cxx_runtime_advice(library_dir: Path | None = None, preload: str | None = None) -> str:
    """A sentence for a crash report when llama.cpp's libraries bundle the C++ runtime and the
    process has not preloaded the system's; "" otherwise."""
    library = bundled_cxx_runtime(library_dir)
    if library is None:
        return ""
    preloaded = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    if "libstdc++" in preloaded:
        return ""
    return (
        f"{library.name} needs no libstdc++.so.6: the compiler that built llama-cpp-python linked "
        "the C++ runtime into it, and with the system's copy also loaded llama.cpp crashes while "
        f"loading a model; start the node with {PRELOAD_FIX}, or rebuild llama-cpp-python with the "
        "system compiler (CC=/usr/bin/gcc CXX=/usr/bin/g++ pip install --force-reinstall "
        "--no-cache-dir llama-cpp-python)"
    )


__all__ = [
    "PRELOAD_FIX",
    "PRELOAD_LIBRARY",
    "bundled_cxx_runtime",
    "cxx_runtime_advice",
    "elf_needed",
    "llama_library_dir",
    "preloaded_environment",
]
