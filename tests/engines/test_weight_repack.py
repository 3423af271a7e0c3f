"""The --weight-repack policy: which settings are probed, and that an AMX CPU never gets the AMX buffer
under auto with the build known to crash on it (checked here with a real probe, on any CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.engine_guard import choose_weight_repack
from engines.engine_probe import ProbeTarget, probe
from engines.llama_lib import llama_cpp_version
from engines.weight_repack import WeightRepack, cpu_features, known_crash, plan_repack

# llama_print_system_info() on the Sapphire Rapids VM where the crash was found (2026-12-01).
AMX_CPU = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
    "OPENMP = 1 | REPACK = 1 | "
)
# The same machine without AMX (an AVX-512 Ice Lake, say).
AVX512_CPU = AMX_CPU.replace("AMX_INT8 = 1 | ", "")
PINNED = "0.3.36"


def test_cpu_features_are_read_from_the_system_info_line():
    features = cpu_features(AMX_CPU)
    assert {"AVX2", "AVX512", "AMX_INT8", "REPACK"} <= features
    assert "AMX_INT8" not in cpu_features(AVX512_CPU)
    assert cpu_features("CPU : AVX2 = 0 | NEON = 1 |") == {"NEON"}


def test_auto_on_an_amx_cpu_with_the_pinned_build_never_tries_repacking():
    plan = plan_repack(WeightRepack.AUTO, AMX_CPU, PINNED)
    assert plan.candidates == (False,)
    assert not plan.may_repack
    assert "AMX_INT8" in plan.skipped and PINNED in plan.skipped


def test_auto_elsewhere_probes_repacking_first_and_keeps_off_as_the_fallback():
    assert plan_repack(WeightRepack.AUTO, AVX512_CPU, PINNED).candidates == (True, False)
    # Another build is not known to crash: it is measured, not assumed.
    assert known_crash(cpu_features(AMX_CPU), "0.3.99") is None
    assert plan_repack(WeightRepack.AUTO, AMX_CPU, "0.3.99").candidates == (True, False)


def test_explicit_settings_are_probed_as_given():
    assert plan_repack(WeightRepack.ON, AMX_CPU, PINNED).candidates == (True,)
    assert plan_repack(WeightRepack.OFF, AVX512_CPU, PINNED).candidates == (False,)


def test_parse_refuses_anything_but_the_three_settings():
    assert WeightRepack.parse(" Auto ") is WeightRepack.AUTO
    with pytest.raises(ValueError, match="auto, on or off"):
        WeightRepack.parse("yes")


@pytest.mark.slow
def test_fed_an_amx_cpu_auto_loads_gemma_without_the_amx_buffer(gemma_model: Path, tmp_path: Path):
    """On any CPU: told it runs on an AMX CPU, auto chooses no repacking, and the real probe's
    load (Gemma's q4_K/q6_K/q8_0 weights, which the AMX buffer would take) used no extra buffer."""
    if llama_cpp_version() != PINNED:
        pytest.skip(f"the known crash is recorded for llama-cpp-python {PINNED}")
    probed: list[ProbeTarget] = []

    def prober(target: ProbeTarget):
        probed.append(target)
        return probe(target)

    target = ProbeTarget(gemma_model, 0, 9, threads=2, cache_dir=tmp_path)
    choice = choose_weight_repack(WeightRepack.AUTO, target, prober=prober, machine=AMX_CPU)
    assert choice.weight_repack is False
    assert [t.weight_repack for t in probed] == [False]
    ((_, verdict),) = choice.verdicts
    assert verdict.survived, verdict.detail
    assert set(verdict.weight_buffers) == {"CPU_Mapped"}, verdict.weight_buffers
    assert "AMX_INT8" in choice.summary()
