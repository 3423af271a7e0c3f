"""A set of CPU numbers as ``ServedShard.cpu_mask`` carries it: bit b of byte i is CPU 8i + b.

A bit set keeps a node's record small (two bytes for 16 CPUs) and bounds what a reader builds
from it: a mask longer than :data:`MAX_CPU_MASK_BYTES` reads as unsaid. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable

# 4096 CPUs: more than one machine a head plans for has.
MAX_CPU_MASK_BYTES = 512


def cpu_mask(cpus: Iterable[int]) -> bytes:
    """The mask of ``cpus`` (each 0 <= cpu < 8 * MAX_CPU_MASK_BYTES; others are left out)."""
    mask = bytearray()
    for cpu in cpus:
        if not 0 <= cpu < 8 * MAX_CPU_MASK_BYTES:
            continue
        byte, bit = divmod(cpu, 8)
        if byte >= len(mask):
            mask.extend(bytes(byte + 1 - len(mask)))
        mask[byte] |= 1 << bit
    return bytes(mask)


def cpus_of_mask(mask: bytes) -> frozenset[int]:
    """The CPUs ``mask`` names; none (unsaid) for a mask longer than MAX_CPU_MASK_BYTES."""
    if len(mask) > MAX_CPU_MASK_BYTES:
        return frozenset()
    return frozenset(
        8 * index + bit for index, byte in enumerate(mask) for bit in range(8) if byte >> bit & 1
    )


__all__ = ["MAX_CPU_MASK_BYTES", "cpu_mask", "cpus_of_mask"]
