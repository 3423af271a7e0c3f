"""The memory of the GPUs llama.cpp would offload layers to, as its backend registry reports it.

A node that places itself (meshnode.autoplace) with ``--n-gpu-layers`` puts its weights in
VRAM, so the range it takes is sized to the GPUs' free memory rather than free RAM. ggml's
device API is not bound by llama_cpp; the few functions needed are bound here, read-only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

from llama_cpp import _ggml

from engines.llama_lib import ensure_llama_backend

# enum ggml_backend_dev_type (ggml-backend.h): CPU 0, GPU 1, ACCEL 2, IGPU 3 (integrated).
_GPU_TYPES = {1: "gpu", 3: "igpu"}
_CPU_TYPE = 0

_lib = _ggml.libggml
_lib.ggml_backend_dev_count.argtypes = []
_lib.ggml_backend_dev_count.restype = ctypes.c_size_t
_lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
_lib.ggml_backend_dev_get.restype = ctypes.c_void_p
_lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
_lib.ggml_backend_dev_type.restype = ctypes.c_int
_lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
_lib.ggml_backend_dev_name.restype = ctypes.c_char_p
_lib.ggml_backend_dev_memory.argtypes = [
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_size_t),
]
_lib.ggml_backend_dev_memory.restype = None
_lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
_lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    kind: str
    free_bytes: int
    total_bytes: int


def offload_devices() -> list[DeviceMemory]:
    """Every GPU (discrete or integrated) this build of llama.cpp can offload to, with its
    memory now; empty on a CPU-only build or machine."""
    ensure_llama_backend()
    devices = []
    for index in range(_lib.ggml_backend_dev_count()):
        device = _lib.ggml_backend_dev_get(index)
        kind = _GPU_TYPES.get(_lib.ggml_backend_dev_type(device))
        if kind is None:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        name = (_lib.ggml_backend_dev_name(device) or b"?").decode("utf-8", "replace")
        devices.append(DeviceMemory(name, kind, int(free.value), int(total.value)))
    return devices


def _first_buffer_type(device_types: Iterable[int]) -> int | None:
    ensure_llama_backend()
    for index in range(_lib.ggml_backend_dev_count()):
        device = _lib.ggml_backend_dev_get(index)
        if _lib.ggml_backend_dev_type(device) in device_types:
            return _lib.ggml_backend_dev_buffer_type(device) or None
    return None


def first_offload_buffer_type() -> int | None:
    """The weight buffer type (``ggml_backend_buffer_type_t``) of the first GPU llama.cpp
    offloads layers to, the one its first offloaded layers go to; None without a GPU."""
    return _first_buffer_type(_GPU_TYPES)


def cpu_buffer_type() -> int:
    """The CPU device's weight buffer type (what an override to the CPU names)."""
    buffer_type = _first_buffer_type({_CPU_TYPE})
    if buffer_type is None:
        raise RuntimeError("llama.cpp registered no CPU device")
    return buffer_type


__all__ = ["DeviceMemory", "cpu_buffer_type", "first_offload_buffer_type", "offload_devices"]
