"""A node that offloads (--n-gpu-layers) sizes the range it takes to GPU memory, not RAM."""

from __future__ import annotations

import logging

import llama_cpp
import pytest

from engines.device_memory import offload_devices
from meshnode.autoplace.memory_budget import machine_budget, read_machine_budget

MEMINFO = "MemTotal: 4000000 kB\nMemAvailable:    2000000 kB\n"


def test_with_gpu_memory_the_budget_is_half_of_it_and_ram_does_not_count():
    assert machine_budget(MEMINFO, None, gpu_free_bytes=80 * 2**30) == 40 * 2**30
    assert machine_budget("", None, gpu_free_bytes=8 * 2**30) == 4 * 2**30
    assert machine_budget(MEMINFO, 2**30, gpu_free_bytes=80 * 2**30) == 2**30  # --memory-budget caps it


@pytest.mark.skipif(bool(llama_cpp.llama_supports_gpu_offload()), reason="this build offloads to a GPU")
def test_on_a_cpu_build_no_gpu_is_seen_and_an_offloading_node_falls_back_to_ram(tmp_path, caplog):
    assert offload_devices() == []
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    with caplog.at_level(logging.WARNING, logger="meshnode.autoplace"):
        assert read_machine_budget(None, offload=True, meminfo_path=meminfo) == 1_024_000_000
    assert "llama.cpp sees no GPU" in caplog.text


@pytest.mark.skipif(not llama_cpp.llama_supports_gpu_offload(), reason="a CPU-only build of llama.cpp")
def test_a_gpu_build_reports_each_gpus_free_and_total_memory():
    devices = offload_devices()
    assert devices, "a build that offloads sees at least one GPU"
    assert all(0 < device.free_bytes <= device.total_bytes for device in devices)
