"""Tensor buffer-type overrides handed to llama.cpp at load (``tensor_buft_overrides``).

One override is needed today. A middle slice declares no vocabulary, so its stand-in
``token_embd`` has no bytes (engines.slicing). llama.cpp keeps the input layer on the CPU
and maps the CPU's weights straight from the file, over the byte range its CPU tensors span;
when every layer and the output go to a GPU, that empty table is the CPU's only tensor, the
range is empty, no mapped buffer is made, and the load aborts the process in
``load_all_data`` (``GGML_ASSERT(buf_mmap || cur->data)``; seen on an H200 with CUDA,
bench/RESULTS.md). Placing the empty table with the offloaded layers leaves the CPU nothing
to map. The table is never read (a middle slice is fed hidden states), so where it lives
changes no result.

llama-cpp-python binds ``tensor_buft_overrides`` as a bare pointer: the NULL-terminated
array of ``{pattern, buffer type}`` is built here and must outlive the load call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

# llama.cpp matches each pattern with std::regex_search against the tensor's name.
INPUT_TABLE_PATTERN = r"^token_embd\.weight$"


class _Override(ctypes.Structure):
    # struct llama_model_tensor_buft_override (llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class BufferOverrides:
    """A NULL-terminated override array kept alive for as long as this object is."""

    _array: ctypes.Array[_Override]

    @property
    def address(self) -> int:
        """What ``llama_model_params.tensor_buft_overrides`` takes."""
        return ctypes.addressof(self._array)


def build_overrides(rules: Sequence[tuple[str, int]]) -> BufferOverrides:
    """``rules``: (pattern, ggml_backend_buffer_type_t as an int) pairs, first match wins."""
    array = (_Override * (len(rules) + 1))()
    for slot, (pattern, buffer_type) in zip(array, rules, strict=False):
        slot.pattern = pattern.encode()
        slot.buft = buffer_type
    # The last slot stays zeroed: pattern NULL ends the list.
    return BufferOverrides(array)


def empty_input_table_rules(
    *, keeps_vocabulary: bool, n_gpu_layers: int, gpu_buffer_type: int | None
) -> list[tuple[str, int]]:
    """The overrides a slice loads with: a slice without a vocabulary puts its empty
    ``token_embd`` with the offloaded layers whenever it offloads any (harmless when some
    layers stay on the CPU, whose mapped range then holds their bytes)."""
    if keeps_vocabulary or n_gpu_layers == 0 or gpu_buffer_type is None:
        return []
    return [(INPUT_TABLE_PATTERN, gpu_buffer_type)]


__all__ = ["INPUT_TABLE_PATTERN", "BufferOverrides", "build_overrides", "empty_input_table_rules"]
