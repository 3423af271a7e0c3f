"""The override array handed to llama.cpp, and which slices get one (engines.buffer_overrides)."""

from __future__ import annotations

import ctypes

from engines.buffer_overrides import INPUT_TABLE_PATTERN, build_overrides, empty_input_table_rules


def test_the_array_holds_each_rule_in_order_and_ends_with_a_null_pattern() -> None:
    overrides = build_overrides([("^a$", 0x1000), ("^b$", 0x2000)])

    class Slot(ctypes.Structure):
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    slots = (Slot * 3).from_address(overrides.address)
    assert [(s.pattern, s.buft) for s in slots] == [(b"^a$", 0x1000), (b"^b$", 0x2000), (None, None)]


def test_only_a_slice_without_a_vocabulary_that_offloads_gets_the_input_table_rule() -> None:
    gpu = 0xABC0
    assert empty_input_table_rules(keeps_vocabulary=False, n_gpu_layers=99, gpu_buffer_type=gpu) == [
        (INPUT_TABLE_PATTERN, gpu)
    ]
    # Negative n_gpu_layers means every layer to llama.cpp.
    assert empty_input_table_rules(keeps_vocabulary=False, n_gpu_layers=-1, gpu_buffer_type=gpu)
    assert empty_input_table_rules(keeps_vocabulary=True, n_gpu_layers=99, gpu_buffer_type=gpu) == []
    assert empty_input_table_rules(keeps_vocabulary=False, n_gpu_layers=0, gpu_buffer_type=gpu) == []
    # A CPU-only build has no GPU to name.
    assert empty_input_table_rules(keeps_vocabulary=False, n_gpu_layers=99, gpu_buffer_type=None) == []
