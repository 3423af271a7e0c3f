"""How many bytes of model weights this machine takes on when it places itself.

Half of the memory available now (``MemAvailable``), the other half left for the KV
caches (``--kv-budget`` takes its share once the weights are loaded), llama.cpp's compute
buffers and everything else the machine runs; ``--memory-budget`` caps it. With
``--n-gpu-layers`` the weights go to VRAM, which this module does not measure: such a
node should say ``--memory-budget`` (it is logged when it does not).
"""

from __future__ import annotations

from pathlib import Path

from meshnode.dataplane.kv_budget import mem_available_bytes

_WEIGHT_SHARE = 0.5


def machine_budget(meminfo: str, cap: int | None) -> int | None:
    """Bytes of weights to take on: ``cap``, or half ``MemAvailable`` when smaller; None when
    neither is known."""
    available = mem_available_bytes(meminfo)
    share = None if available is None else int(available * _WEIGHT_SHARE)
    if cap is None:
        return share
    return cap if share is None else min(cap, share)


def read_machine_budget(cap: int | None, meminfo_path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        meminfo = meminfo_path.read_text()
    except OSError:
        meminfo = ""
    return machine_budget(meminfo, cap)


__all__ = ["machine_budget", "read_machine_budget"]
