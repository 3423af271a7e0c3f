"""The engine probe: a real child process decodes with the configuration; a child killed by a
signal is a cached verdict that refuses the setting with the fix, never a crash of the caller."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from helpers.probe_children import SEGFAULTING_CHILD

from engines import engine_probe
from engines.engine_guard import EngineProbeRefusal, choose_weight_repack
from engines.engine_probe import ProbeTarget, ProbeVerdict, probe, run_child, system_info
from engines.weight_repack import WeightRepack, cpu_features, known_crash

FAILING_CHILD = (sys.executable, "-c", "raise SystemExit('cannot read the model')")


@pytest.fixture
def crashing_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_probe, "CHILD_COMMAND", SEGFAULTING_CHILD)


def test_a_probe_decodes_every_kind_of_shard_in_a_child(tiny_model: Path, tmp_path: Path):
    for start, end in ((0, 3), (3, None), (2, 4)):
        verdict = run_child(ProbeTarget(tiny_model, start, end, threads=1, cache_dir=tmp_path))
        assert verdict.survived, (start, end, verdict.detail, verdict.stderr_tail)
        assert verdict.signal_number is None and not verdict.crashed
        # The tiny model's weights are F32, which no extra buffer takes.
        assert "CPU_Mapped" in verdict.weight_buffers


def test_a_verdict_is_cached_per_key(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    target = ProbeTarget(tiny_model, 0, 3, threads=1, cache_dir=tmp_path)
    first = probe(target)
    assert first.survived and not first.cached
    monkeypatch.setattr(engine_probe, "CHILD_COMMAND", SEGFAULTING_CHILD)
    again = probe(target)
    assert again.survived and again.cached, "the second start must not run a child"
    # Another repack setting is another key: it runs its own child (which now crashes).
    other = probe(ProbeTarget(tiny_model, 0, 3, threads=1, cache_dir=tmp_path, weight_repack=True))
    assert not other.cached and other.signal_number == signal.SIGSEGV
    assert probe(ProbeTarget(tiny_model, 0, 3, threads=1, cache_dir=tmp_path, weight_repack=True)).cached


def test_a_build_named_by_llama_cpp_lib_path_is_another_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """llama-cpp-python loads its libraries from ``LLAMA_CPP_LIB_PATH`` when that is set: a verdict
    proved on its own ``lib/`` must not answer for another build loaded that way."""
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    own = engine_probe.llama_build_id()
    other = tmp_path / "other-build"
    other.mkdir()
    (other / "libllama.so").write_bytes(b"another build")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(other))
    named = engine_probe.llama_build_id()
    assert named != own and named.split("+")[0] == own.split("+")[0]
    (other / "libggml-cpu.so").write_bytes(b"its CPU backend")
    assert engine_probe.llama_build_id() != named


def test_a_verdict_on_one_role_or_offload_does_not_answer_for_another(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A fully offloaded middle slice died on a GPU where a head loaded (engines.buffer_overrides):
    a head's survival must not let a middle range load unprobed, nor a middle's crash refuse a head."""
    placements = {
        (0, None, 0): ("whole", "none"),
        (0, 3, 2): ("head", "part"),
        (2, 4, 99): ("middle", "all"),
        # The middle slice [2, 4) holds 2 layers and the passthrough layer: 3 leave the output on the CPU.
        (2, 4, 3): ("middle", "part"),
        (2, 4, 4): ("middle", "all"),
        (3, None, -1): ("tail", "all"),
        (4, 9, 99): ("outside the model", "none"),
    }
    for (start, end, layers), expected in placements.items():
        assert engine_probe.placement(ProbeTarget(tiny_model, start, end, n_gpu_layers=layers)) == expected
    head = ProbeTarget(tiny_model, 0, 3, n_gpu_layers=99, threads=1, cache_dir=tmp_path)
    assert probe(head).survived
    monkeypatch.setattr(engine_probe, "CHILD_COMMAND", SEGFAULTING_CHILD)
    middle = probe(ProbeTarget(tiny_model, 2, 4, n_gpu_layers=99, threads=1, cache_dir=tmp_path))
    assert not middle.cached and middle.signal_number == signal.SIGSEGV
    assert probe(head).cached and probe(head).survived


def test_a_child_killed_by_a_signal_is_a_verdict_naming_it(tiny_model: Path, tmp_path: Path, crashing_child):
    verdict = run_child(ProbeTarget(tiny_model, cache_dir=tmp_path))
    assert not verdict.survived and verdict.crashed
    assert verdict.signal_number == signal.SIGSEGV
    assert verdict.signal_name.startswith("SIGSEGV (signal 11")
    assert "Fatal Python error: Segmentation fault" in verdict.stderr_tail


def test_an_explicit_setting_that_crashes_is_refused_with_the_fix(
    tiny_model: Path, tmp_path: Path, crashing_child
):
    target = ProbeTarget(tiny_model, 0, 3, cache_dir=tmp_path)
    with pytest.raises(EngineProbeRefusal) as refused:
        choose_weight_repack(WeightRepack.ON, target)
    message = str(refused.value)
    assert "SIGSEGV" in message and "--weight-repack on" in message
    assert "start with --weight-repack off" in message
    assert "Fatal Python error: Segmentation fault" in message


def test_auto_falls_back_to_no_repacking_when_repacking_crashes(tiny_model: Path, tmp_path: Path):
    def prober(target: ProbeTarget) -> ProbeVerdict:
        if target.weight_repack:
            return ProbeVerdict(survived=False, signal_number=int(signal.SIGILL), detail="died of SIGILL")
        return ProbeVerdict(survived=True, detail="ok")

    choice = choose_weight_repack(
        WeightRepack.AUTO,
        ProbeTarget(tiny_model, cache_dir=tmp_path),
        prober=prober,
        machine="CPU : AVX2 = 1 |",
    )
    assert choice.weight_repack is False
    assert [repack for repack, _ in choice.verdicts] == [True, False]
    assert "died of SIGILL" in choice.summary()


def test_when_no_setting_survives_the_refusal_says_so(tiny_model: Path, tmp_path: Path, crashing_child):
    with pytest.raises(EngineProbeRefusal) as refused:
        choose_weight_repack(
            WeightRepack.AUTO, ProbeTarget(tiny_model, cache_dir=tmp_path), machine="CPU : AVX2 = 1 |"
        )
    assert [repack for repack, _ in refused.value.verdicts] == [True, False]
    assert "no setting avoids it" in str(refused.value)
    assert "--weight-repack auto (tried off)" in str(refused.value)


def test_a_child_that_fails_in_python_is_not_a_verdict_on_the_setting(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(engine_probe, "CHILD_COMMAND", FAILING_CHILD)
    target = ProbeTarget(tiny_model, cache_dir=tmp_path)
    verdict = probe(target)
    assert not verdict.survived and not verdict.crashed and verdict.exit_code == 1
    assert "cannot read the model" in verdict.detail
    # Not cached: the next start probes again.
    assert not probe(target).cached
    # The node goes on and lets the engine's own load say what is wrong.
    assert choose_weight_repack(WeightRepack.OFF, target).weight_repack is False


@pytest.mark.slow
def test_on_a_cpu_this_build_crashes_on_the_real_probe_dies_and_auto_avoids_it(
    gemma_model: Path, tmp_path: Path
):
    """The crash itself, where this machine has it: repacked Gemma kills the probe's child."""
    crash = known_crash(cpu_features(system_info()), engine_probe.llama_build_id().split("+")[0])
    if crash is None:
        pytest.skip("this CPU and llama.cpp build are not known to crash with repacked weights")
    target = ProbeTarget(gemma_model, 0, 9, threads=2, cache_dir=tmp_path)
    with pytest.raises(EngineProbeRefusal) as refused:
        choose_weight_repack(WeightRepack.ON, target)
    ((repack, verdict),) = refused.value.verdicts
    assert repack and verdict.signal_number in (signal.SIGSEGV, signal.SIGILL), verdict.detail
    assert choose_weight_repack(WeightRepack.AUTO, target).weight_repack is False
