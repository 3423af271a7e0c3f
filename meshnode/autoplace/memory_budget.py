"""How many bytes of model weights this machine takes on when it places itself.

Half of the memory available now, the other half left for the KV caches (``--kv-budget``
takes its share once the weights are loaded), llama.cpp's compute buffers and everything
else the machine runs; ``--memory-budget`` caps it. The memory is RAM (``MemAvailable``),
or, for a node that offloads (``--n-gpu-layers``), the free memory of the GPUs llama.cpp
reports (engines.device_memory), where the weights, KV and buffers then go.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshnode.dataplane.kv_budget import mem_available_bytes

log = logging.getLogger(__name__)

_WEIGHT_SHARE = 0.5


def machine_budget(meminfo: str, cap: int | None, *, gpu_free_bytes: int | None = None) -> int | None:
    """Bytes of weights to take on: ``cap``, or half the free memory when smaller (the GPUs'
    ``gpu_free_bytes`` when given, else ``MemAvailable``); None when neither is known."""
    available = mem_available_bytes(meminfo) if gpu_free_bytes is None else gpu_free_bytes
    share = None if available is None else int(available * _WEIGHT_SHARE)
    if cap is None:
        return share
    return cap if share is None else min(cap, share)


def gpu_free_bytes() -> int | None:
    """Free memory of every GPU llama.cpp can offload to, together; None when it sees none."""
    from engines.device_memory import offload_devices  # loads llama.cpp: only for an offloading node

    devices = offload_devices()
    if not devices:
        log.warning("--n-gpu-layers, but llama.cpp sees no GPU: the range is sized to free RAM")
        return None
    log.info(
        "sizing the range to GPU memory: %s",
        ", ".join(
            f"{d.name} {d.free_bytes / 2**30:.1f} of {d.total_bytes / 2**30:.1f} GiB free" for d in devices
        ),
    )
    return sum(device.free_bytes for device in devices)


def read_machine_budget(
    cap: int | None, *, offload: bool = False, meminfo_path: Path = Path("/proc/meminfo")
) -> int | None:
    try:
        meminfo = meminfo_path.read_text()
    except OSError:
        meminfo = ""
    return machine_budget(meminfo, cap, gpu_free_bytes=gpu_free_bytes() if offload else None)


__all__ = ["gpu_free_bytes", "machine_budget", "read_machine_budget"]
