"""llama.cpp libraries that carry their own C++ runtime: found from the ELF file, named in the
refusal with the fix, and a verdict taken before the fix does not outlive it."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.probe_children import CRASHING_UNLESS_PRELOADED, SEGFAULTING_CHILD

from engines import cxx_runtime, engine_probe
from engines.cxx_runtime import PRELOAD_FIX, bundled_cxx_runtime, cxx_runtime_advice, elf_needed
from engines.engine_guard import EngineProbeRefusal, choose_weight_repack
from engines.engine_probe import ProbeTarget, probe
from engines.weight_repack import WeightRepack

# What llama_model::print_info does where the H100 machine's build died: format into a stream.
SOURCE = """
#include <sstream>
extern "C" int formatted_length(long value) {
    std::ostringstream stream;
    stream << value;
    return (int)stream.str().size();
}
"""


def _build_libllama(directory: Path, *flags: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build a C++ library with")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "library.cpp"
    source.write_text(SOURCE)
    library = directory / "libllama.so"
    subprocess.run(["g++", "-shared", "-fPIC", *flags, "-o", str(library), str(source)], check=True)
    return library


@pytest.fixture
def static_runtime_dir(tmp_path: Path) -> Path:
    return _build_libllama(tmp_path / "static", "-static-libstdc++").parent


def test_a_library_with_the_cxx_runtime_linked_in_is_found(static_runtime_dir: Path):
    needed = elf_needed(static_runtime_dir / "libllama.so")
    assert needed is not None and "libc.so.6" in needed
    assert not any(name.startswith("libstdc++") for name in needed)
    assert bundled_cxx_runtime(static_runtime_dir) == static_runtime_dir / "libllama.so"
    advice = cxx_runtime_advice(static_runtime_dir, preload="")
    assert PRELOAD_FIX in advice and "libllama.so needs no libstdc++.so.6" in advice
    # Once the system's runtime is preloaded, every library binds to it: nothing to advise.
    assert cxx_runtime_advice(static_runtime_dir, preload="/usr/lib/libstdc++.so.6") == ""


def test_a_library_linking_the_shared_runtime_is_not_flagged(tmp_path: Path):
    library = _build_libllama(tmp_path / "dynamic")
    assert "libstdc++.so.6" in (elf_needed(library) or ())
    assert bundled_cxx_runtime(library.parent) is None
    assert cxx_runtime_advice(library.parent, preload="") == ""


def test_the_installed_llama_cpp_links_the_shared_runtime():
    """The build this suite runs on (pip from the sdist with the system compiler)."""
    needed = elf_needed(cxx_runtime.llama_library_dir() / "libllama.so")
    assert needed is not None and any(name.startswith("libggml") for name in needed)
    assert bundled_cxx_runtime() is None


def test_the_library_folder_is_the_one_llama_cpp_lib_path_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    own = cxx_runtime.llama_library_dir()
    assert (own / "libllama.so").exists()
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert cxx_runtime.llama_library_dir() == tmp_path


def test_files_that_are_not_64_bit_elf_libraries_are_not_read_as_any(tmp_path: Path):
    text = tmp_path / "libllama.so"
    text.write_text("not a library")
    assert elf_needed(text) is None and bundled_cxx_runtime(tmp_path) is None
    real = (cxx_runtime.llama_library_dir() / "libllama.so").read_bytes()
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(real[:200])
    assert elf_needed(truncated) is None
    assert elf_needed(tmp_path / "missing.so") is None
    assert bundled_cxx_runtime(tmp_path / "nowhere") is None


def _refusal_with_bundled_runtime(
    tiny_model: Path,
    tmp_path: Path,
    runtime_dir: Path,
    child: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    monkeypatch.setattr(cxx_runtime, "llama_library_dir", lambda: runtime_dir)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(engine_probe, "CHILD_COMMAND", child)
    with pytest.raises(EngineProbeRefusal) as refused:
        choose_weight_repack(
            WeightRepack.AUTO, ProbeTarget(tiny_model, cache_dir=tmp_path), machine="CPU : AVX2 = 1 |"
        )
    return str(refused.value)


def test_a_crash_that_the_preload_cures_is_refused_with_that_fix_proven(
    tiny_model: Path, tmp_path: Path, static_runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    message = _refusal_with_bundled_runtime(
        tiny_model, tmp_path, static_runtime_dir, CRASHING_UNLESS_PRELOADED, monkeypatch
    )
    assert "SIGSEGV" in message
    assert f"start the node with {PRELOAD_FIX}" in message
    assert f"(a probe decode with {PRELOAD_FIX} survived)" in message
    # Rebuilding "for this CPU" with the same compiler would not help: that advice is not given.
    assert "rebuild llama-cpp-python for this CPU" not in message


def test_a_crash_the_preload_does_not_cure_keeps_the_settings_fix(
    tiny_model: Path, tmp_path: Path, static_runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    message = _refusal_with_bundled_runtime(
        tiny_model, tmp_path, static_runtime_dir, SEGFAULTING_CHILD, monkeypatch
    )
    assert "no setting avoids it: rebuild llama-cpp-python for this CPU" in message
    assert f"({PRELOAD_FIX} did not help: the engine died of SIGSEGV" in message
    assert "start the node with" not in message


def test_a_crash_with_the_shared_runtime_runs_no_preload_probe(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A build that links the shared runtime (this one) costs a refusal no second child."""
    message = _refusal_with_bundled_runtime(
        tiny_model, tmp_path, cxx_runtime.llama_library_dir(), SEGFAULTING_CHILD, monkeypatch
    )
    assert "no setting avoids it" in message and PRELOAD_FIX not in message


def test_a_crash_verdict_taken_without_the_preload_does_not_refuse_with_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The user follows the fix: the cached crash must not refuse the next start."""
    target = ProbeTarget(tiny_model, 0, 3, threads=1, cache_dir=tmp_path)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with monkeypatch.context() as crashing:
        crashing.setattr(engine_probe, "CHILD_COMMAND", SEGFAULTING_CHILD)
        assert probe(target).signal_number == signal.SIGSEGV
    assert probe(target).cached, "without a change the crash is remembered"
    monkeypatch.setenv("LD_PRELOAD", "libstdc++.so.6")
    fixed = probe(target)
    assert fixed.survived and not fixed.cached
