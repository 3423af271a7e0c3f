"""Whether llama.cpp may repack a model's weights at load: the ``--weight-repack`` policy. Pure.

llama.cpp's CPU backend can copy weights into "extra" buffer types at load, laid out for
the CPU's matrix units: ``AMX`` on Intel CPUs with Advanced Matrix Extensions,
``CPU_REPACK`` for AVX2/AVX-512 or NEON kernels. That is often the fastest choice, and on
some machines it kills the process: the pinned llama.cpp repacks Gemma 3 270M into an AMX
buffer and then dies in its first ``llama_decode`` (SIGSEGV on the VM where it was found,
SIGILL on another). So the choice is deliberate:

- ``off``: never repack (the weights stay in the mmapped file);
- ``on``: repack wherever llama.cpp offers to, after a probe decode in a child process
  has survived it (``engines.engine_probe``);
- ``auto`` (the default): like ``on`` where the probe survives, else ``off`` — except on
  CPUs where this llama.cpp build is known to crash with it, which are not even probed, and
  where, on a node computing on the CPU, repacking would hold less than half of the shard's
  weights (:func:`repacked_share`).

This module only decides which settings to try, in order; the probe measures them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class WeightRepack(Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, text: str) -> WeightRepack:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"weight repack must be auto, on or off, not {text!r}") from None


# "... AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | ...", as llama_print_system_info() prints it.
_FEATURE = re.compile(r"([A-Z0-9_]+) = 1\b")


def cpu_features(system_info: str) -> frozenset[str]:
    """The features llama.cpp's CPU backend reports as present (``AVX2``, ``AMX_INT8``, ...)."""
    return frozenset(_FEATURE.findall(system_info))


@dataclass(frozen=True)
class KnownCrash:
    """A (llama.cpp build, CPU feature) pair whose extra buffers kill the process."""

    llama_cpp_python: str
    feature: str
    why: str


# Seen 2026-12-01 on two Sapphire Rapids-class VMs: the AMX buffer repacks q4_K/q6_K/q8_0
# weights, and the first decode dies (SIGSEGV on one, SIGILL on the other).
KNOWN_CRASHES: tuple[KnownCrash, ...] = (
    KnownCrash(
        "0.3.36",
        "AMX_INT8",
        "llama-cpp-python 0.3.36 dies in its first decode with weights in its AMX buffer",
    ),
)


@dataclass(frozen=True)
class RepackPlan:
    """What to load with: each candidate (True = repack) is probed in order, the first that
    survives is used. ``skipped`` says why a candidate was left out without probing."""

    candidates: tuple[bool, ...]
    skipped: str = ""

    @property
    def may_repack(self) -> bool:
        return True in self.candidates


def known_crash(features: frozenset[str], llama_cpp_python: str) -> KnownCrash | None:
    for crash in KNOWN_CRASHES:
        if crash.llama_cpp_python == llama_cpp_python and crash.feature in features:
            return crash
    return None


def plan_repack(setting: WeightRepack, system_info: str, llama_cpp_python: str) -> RepackPlan:
    """The settings to probe, in order, for ``setting`` on the CPU that ``system_info`` describes.

    An explicit ``on`` is tried even on a CPU known to crash (the probe then refuses it with
    the fix); ``auto`` never tries what is known to crash.
    """
    if setting is WeightRepack.OFF:
        return RepackPlan((False,))
    if setting is WeightRepack.ON:
        return RepackPlan((True,))
    crash = known_crash(cpu_features(system_info), llama_cpp_python)
    if crash is not None:
        return RepackPlan(
            (False,), skipped=f"not repacking weights: {crash.why} (this CPU has {crash.feature})"
        )
    return RepackPlan((True, False))


# Under auto, repacking is kept only where it holds at least this share of the weights in host
# memory. Its kernels then do most of a decode's work; where it holds less, the little they
# speed up costs batched sessions their larger passes: with repacked weights a pass spans at
# most 3 sessions and each reads the repacked tensors on its own (engines.row_invariance:
# llama.cpp's repacked kernels give other bits from 4 rows on), where plain weights take 7
# sessions a pass and are read once for all of them. Gemma 3 270M Q4_K_M repacks 13 of its
# 235 MiB (its Q8_0 embedding, also its output matrix, and its Q5_0 weights are not): three
# nodes at concurrency 4 gave 45.3 tokens/s repacked and 53.6 not, 36.1 and 36.0 alone.
MIN_REPACKED_SHARE = 0.5


def repacked_share(weight_buffers: Mapping[str, float]) -> float | None:
    """The share of the host's weights a load put in repacking buffer types (``CPU_REPACK``,
    ``AMX``, ...), from its buffer sizes (name -> MiB); None when it reported none on the host
    (every layer offloaded, or nothing reported).

    ``CPU_Mapped`` is the span of the mmapped file its tensors lie in, and the repacked tensors
    lie among them, so with mmap it counts them too (Gemma 3 270M Q4_K_M: mapped 235 MiB, the
    whole file's weights, and 13 of them repacked as well); without mmap, ``CPU`` holds only what
    was not repacked. A tied output matrix is repacked as a copy of the embedding, so the share
    is capped at 1."""
    mapped = weight_buffers.get("CPU_Mapped", 0.0)
    plain = weight_buffers.get("CPU", 0.0)
    repacked = sum(
        mib
        for name, mib in weight_buffers.items()
        if (name.startswith("CPU") or name == "AMX") and name not in ("CPU", "CPU_Mapped")
    )
    total = max(mapped + plain, plain + repacked)
    if total <= 0:
        return None
    return min(1.0, repacked / total)


def too_little_repacked(weight_buffers: Mapping[str, float]) -> str:
    """Why repacking is not worth it for a load with these buffer sizes ("": it is)."""
    share = repacked_share(weight_buffers)
    if share is None or share >= MIN_REPACKED_SHARE:
        return ""
    return (
        f"not repacking weights: it would hold {share:.0%} of them, too little to pay for "
        f"batched sessions' smaller passes (at most 3 a pass instead of 7)"
    )


def describe(repack: bool) -> str:
    return "on" if repack else "off"


__all__ = [
    "KNOWN_CRASHES",
    "MIN_REPACKED_SHARE",
    "KnownCrash",
    "RepackPlan",
    "WeightRepack",
    "cpu_features",
    "describe",
    "known_crash",
    "plan_repack",
    "repacked_share",
    "too_little_repacked",
]
