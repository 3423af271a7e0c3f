"""Choose the weight-repack setting a node loads with, or refuse to start: policy plus probe.

``choose_weight_repack`` asks ``engines.weight_repack`` which settings to try, proves each
with ``engines.engine_probe`` in a child process, and returns the first that survived.
A setting that killed its probe is never loaded in the node's own process: an explicit
choice that crashes is refused with a message naming the signal, the setting and the
option that avoids it; under ``auto`` the next candidate is tried. Where llama.cpp's libraries
carry their own C++ runtime (engines.cxx_runtime), one more child tries the crashed setting with
the system's runtime preloaded, and the refusal advises that only where it survived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engines.cxx_runtime import PRELOAD_FIX, cxx_runtime_advice, preloaded_environment
from engines.engine_probe import ProbeTarget, ProbeVerdict, probe, run_child, system_info
from engines.llama_lib import llama_cpp_version
from engines.weight_repack import WeightRepack, cpu_features, describe, plan_repack, too_little_repacked

log = logging.getLogger(__name__)

Prober = Callable[[ProbeTarget], ProbeVerdict]


class EngineProbeRefusal(Exception):
    """No setting survived its probe; the message says what died, how, and what to do."""

    def __init__(self, message: str, verdicts: list[tuple[bool, ProbeVerdict]]) -> None:
        super().__init__(message)
        self.verdicts = verdicts


@dataclass(frozen=True)
class RepackChoice:
    weight_repack: bool
    # Each probed candidate (True = repack) with its verdict, in the order tried.
    verdicts: list[tuple[bool, ProbeVerdict]] = field(default_factory=list)
    # Why a candidate was not even probed (a CPU this build is known to crash on).
    skipped: str = ""

    def summary(self) -> str:
        """One log line: the setting, why, and what the probes said."""
        parts = [f"weight repack {describe(self.weight_repack)}"]
        if self.skipped:
            parts.append(self.skipped)
        for repack, verdict in self.verdicts:
            how = "cached verdict" if verdict.cached else f"probed in {verdict.seconds:.1f} s"
            outcome = "survived a probe decode" if verdict.survived else verdict.detail
            buffers = ", ".join(
                f"{name} {mib:.0f} MiB" for name, mib in sorted(verdict.weight_buffers.items())
            )
            parts.append(
                f"repack {describe(repack)} {outcome} ({how}{'; weights in ' + buffers if buffers else ''})"
            )
        return "; ".join(parts)


def _cpu_line(info: str) -> str:
    notable = sorted(
        cpu_features(info) & {"AMX_INT8", "AMX_BF16", "AVX512", "AVX2", "AVX_VNNI", "NEON", "SVE"}
    )
    return ", ".join(notable) if notable else "no SIMD features reported"


def probe_with_system_cxx_runtime(target: ProbeTarget) -> ProbeVerdict:
    """A probe decode in a child with the system's C++ runtime preloaded (engines.cxx_runtime);
    never cached: it only decides what a refusal advises."""
    return run_child(target, extra_env=preloaded_environment())


def _refusal(
    setting: WeightRepack,
    target: ProbeTarget,
    repack: bool,
    verdict: ProbeVerdict,
    info: str,
    preloaded: ProbeVerdict | None = None,
) -> str:
    what = verdict.detail
    where = (
        f"loading {target.describe()} with --weight-repack {setting.value}"
        + (f" (tried {describe(repack)})" if setting is WeightRepack.AUTO else "")
        + f", llama-cpp-python {llama_cpp_version()}, CPU {_cpu_line(info)}"
    )
    if repack:
        fix = "start with --weight-repack off (weights stay as the file has them)"
    elif target.n_gpu_layers > 0:
        fix = "start with --n-gpu-layers 0, or rebuild llama-cpp-python for this GPU"
    else:
        fix = (
            "no setting avoids it: rebuild llama-cpp-python for this CPU "
            "(pip install --force-reinstall --no-cache-dir llama-cpp-python==" + llama_cpp_version() + ")"
        )
    if preloaded is not None and preloaded.survived:
        # Not the setting's fault: no repack or offload choice avoids a split C++ runtime.
        fix = f"{cxx_runtime_advice()} (a probe decode with {PRELOAD_FIX} survived)"
    elif preloaded is not None:
        fix += f" ({PRELOAD_FIX} did not help: {preloaded.detail})"
    message = f"{what}, {where}; {fix}"
    # Threads that die together can cut faulthandler's report to its first words.
    if len(verdict.stderr_tail.splitlines()) > 1:
        message += "\nthe probe's stderr:\n" + "\n".join(
            "    " + line for line in verdict.stderr_tail.splitlines()
        )
    return message


def choose_weight_repack(
    setting: WeightRepack,
    target: ProbeTarget,
    *,
    prober: Prober = probe,
    preload_prober: Prober = probe_with_system_cxx_runtime,
    machine: str | None = None,
) -> RepackChoice:
    """The repack setting to load ``target`` with. Blocks for the probes (seconds; cached after).

    ``machine`` is llama.cpp's system-info string (default: this machine's). Raises
    :class:`EngineProbeRefusal` when every candidate crashed its probe.
    """
    info = system_info() if machine is None else machine
    plan = plan_repack(setting, info, llama_cpp_version())
    verdicts: list[tuple[bool, ProbeVerdict]] = []
    # Why auto passed over repacking that survived its probe ("": it did not); then repacking
    # is loaded only if loading without it does not survive.
    declined = ""
    for repack in plan.candidates:
        verdict = prober(replace(target, weight_repack=repack))
        verdicts.append((repack, verdict))
        if verdict.survived:
            # A GPU node's passes do not follow the setting (engines.llama_engine): CPU nodes only.
            if (
                repack
                and setting is WeightRepack.AUTO
                and False in plan.candidates
                and not target.n_gpu_layers
            ):
                declined = too_little_repacked(verdict.weight_buffers)
                if declined:
                    continue
            return RepackChoice(repack, verdicts, plan.skipped or declined)
        if declined:
            log.warning("weight repack: without it, %s; repacking after all", verdict.detail)
            return RepackChoice(True, verdicts, plan.skipped)
        if not verdict.crashed:
            # The child failed in Python (an unreadable model, no memory): not a verdict on the
            # setting. Load it here and let the engine's own error say what is wrong.
            log.warning(
                "engine probe inconclusive with weight repack %s: %s", describe(repack), verdict.detail
            )
            return RepackChoice(repack, verdicts, plan.skipped)
        if repack and setting is WeightRepack.AUTO:
            log.warning(
                "weight repack: %s with repacked weights; loading without them (--weight-repack off)",
                verdict.detail,
            )
            continue
        break
    repack, verdict = verdicts[-1]
    preloaded = None
    if verdict.crashed and cxx_runtime_advice():
        # llama.cpp carries its own C++ runtime: whether the system's, preloaded, saves it.
        preloaded = preload_prober(replace(target, weight_repack=repack))
    raise EngineProbeRefusal(_refusal(setting, target, repack, verdict, info, preloaded), verdicts)


__all__ = ["EngineProbeRefusal", "Prober", "RepackChoice", "choose_weight_repack"]
