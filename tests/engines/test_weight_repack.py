"""The --weight-repack policy: which settings are probed, and that an AMX CPU never gets the AMX buffer
under auto with the build known to crash on it (checked here with a real probe, on any CPU)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from engines.engine_guard import choose_weight_repack
from engines.engine_probe import ProbeTarget, ProbeVerdict, probe
from engines.llama_lib import llama_cpp_version
from engines.weight_repack import (
    MIN_REPACKED_SHARE,
    WeightRepack,
    cpu_features,
    known_crash,
    plan_repack,
    repacked_share,
)

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


# What Gemma 3 270M Q4_K_M's whole-model load reports on an AVX-512 CPU with repacking.
GEMMA_REPACKED = {"CPU_Mapped": 235.0, "CPU_REPACK": 13.0}


def test_the_repacked_share_counts_the_hosts_weights_once():
    # mmapped: the mapped span holds every weight, the repacked ones too.
    assert repacked_share(GEMMA_REPACKED) == pytest.approx(13 / 235)
    # Gemma requantized to Q4_0 throughout, embedding included (reported so by this build):
    # everything is repacked, the tied output matrix as a copy of the embedding.
    assert repacked_share({"CPU_Mapped": 144.0, "CPU_REPACK": 144.0}) == pytest.approx(1.0)
    assert repacked_share({"CPU_Mapped": 54.0, "CPU_REPACK": 90.0}) == pytest.approx(1.0)  # capped
    # Not mmapped: CPU holds what was not repacked.
    assert repacked_share({"CPU": 222.0, "CPU_REPACK": 13.0}) == pytest.approx(13 / 235)
    assert repacked_share({"CPU": 10.0, "AMX": 90.0}) == pytest.approx(0.9)
    # Offloaded layers do not count: the choice is about the layers the CPU computes.
    assert repacked_share({"CPU_Mapped": 80.0, "CPU_REPACK": 60.0, "CUDA0": 1000.0}) == pytest.approx(0.75)
    assert repacked_share({"CUDA0": 1000.0}) is None
    assert repacked_share({}) is None


def fake_prober(buffers_when_repacked: dict[str, float], *, off_survives: bool = True):
    probed: list[bool] = []

    def prober(target: ProbeTarget) -> ProbeVerdict:
        probed.append(target.weight_repack)
        if target.weight_repack:
            return ProbeVerdict(survived=True, detail="ok", weight_buffers=dict(buffers_when_repacked))
        if not off_survives:
            return ProbeVerdict(survived=False, signal_number=int(signal.SIGILL), detail="died of SIGILL")
        return ProbeVerdict(survived=True, detail="ok", weight_buffers={"CPU_Mapped": 235.0})

    return prober, probed


def test_auto_passes_over_repacking_that_would_hold_too_little_of_the_weights(tmp_path: Path):
    prober, probed = fake_prober(GEMMA_REPACKED)
    target = ProbeTarget(tmp_path / "m.gguf", cache_dir=tmp_path)
    choice = choose_weight_repack(WeightRepack.AUTO, target, prober=prober, machine=AVX512_CPU)
    assert choice.weight_repack is False
    assert probed == [True, False]
    assert "it would hold 6% of them" in choice.summary()


def test_auto_keeps_repacking_that_holds_most_of_the_weights_and_on_is_on_whatever_it_holds(tmp_path: Path):
    target = ProbeTarget(tmp_path / "m.gguf", cache_dir=tmp_path)
    prober, probed = fake_prober({"CPU_Mapped": 240.0, "CPU_REPACK": 200.0})
    assert choose_weight_repack(WeightRepack.AUTO, target, prober=prober, machine=AVX512_CPU).weight_repack
    assert probed == [True]
    prober, probed = fake_prober(GEMMA_REPACKED)
    assert choose_weight_repack(WeightRepack.ON, target, prober=prober, machine=AVX512_CPU).weight_repack
    assert probed == [True]


def test_auto_leaves_a_gpu_nodes_setting_as_it_was(tmp_path: Path):
    prober, probed = fake_prober({"CPU_Mapped": 170.0, "CUDA0": 80.0})
    target = ProbeTarget(tmp_path / "m.gguf", n_gpu_layers=99, cache_dir=tmp_path)
    assert choose_weight_repack(WeightRepack.AUTO, target, prober=prober, machine=AVX512_CPU).weight_repack
    assert probed == [True]


def test_auto_repacks_after_all_when_loading_without_it_does_not_survive(tmp_path: Path):
    prober, probed = fake_prober(GEMMA_REPACKED, off_survives=False)
    target = ProbeTarget(tmp_path / "m.gguf", cache_dir=tmp_path)
    choice = choose_weight_repack(WeightRepack.AUTO, target, prober=prober, machine=AVX512_CPU)
    assert choice.weight_repack is True
    assert probed == [True, False]


@pytest.mark.slow
def test_auto_loads_gemma_as_the_file_has_it_on_this_cpu(gemma_model: Path, tmp_path: Path):
    """With the real probe: on x86 this build repacks Gemma 3 270M Q4_K_M's Q4_K tensors at most,
    6% of its weights (not its 170 MiB Q8_0 embedding, which is also its output matrix), so auto
    loads it unrepacked, and a node's batches get passes of 7 sessions."""
    target = ProbeTarget(gemma_model, 0, 18, threads=2, cache_dir=tmp_path)
    choice = choose_weight_repack(WeightRepack.AUTO, target)
    shares = [repacked_share(verdict.weight_buffers) for repack, verdict in choice.verdicts if repack]
    if any(share is not None and share >= MIN_REPACKED_SHARE for share in shares):
        pytest.skip(f"this CPU's build repacks most of Gemma's weights: {choice.summary()}")
    assert choice.weight_repack is False, choice.summary()
