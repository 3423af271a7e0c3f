"""A node or ``meshnode serve`` whose engine probe dies by a signal refuses to start: a non-zero exit
and a message naming the signal, the setting and the option that avoids it; nothing is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.engine_probe import system_info
from engines.llama_lib import llama_cpp_version
from engines.tiny_model import ensure_tiny_model
from engines.weight_repack import cpu_features, known_crash

CRASHING = Path(__file__).with_name("crashing_probe_meshnode.py")
REPO = Path(__file__).resolve().parents[2]


def run(command: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MESHNODE_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_a_node_whose_probe_dies_of_sigsegv_refuses_to_start(tmp_path: Path):
    done = run(
        [sys.executable, str(CRASHING), "create", "--data-dir", str(tmp_path / "node"),
         "--listen", "127.0.0.1:0", "--api-listen", "off", "--model", str(ensure_tiny_model()),
         "--layers", "0:3", "--weight-repack", "on"],
        tmp_path / "cache",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "meshnode create: refusing to serve meshnode-tiny-llama-v1.gguf" in done.stderr
    assert "the engine died of SIGSEGV (signal 11, segmentation fault) in the probe decode" in done.stderr
    assert "with --weight-repack on" in done.stderr
    assert "start with --weight-repack off" in done.stderr
    assert "serving" not in done.stdout
    # The verdict is kept: the next start refuses at once, from the cache.
    verdicts = list((tmp_path / "cache" / "engine-probes").glob("*.json"))
    assert len(verdicts) == 1 and '"signal_number": 11' in verdicts[0].read_text()


def test_serve_refuses_when_no_setting_survives(tmp_path: Path):
    done = run(
        [
            sys.executable,
            str(CRASHING),
            "serve",
            "--model",
            str(ensure_tiny_model()),
            "--api-listen",
            "127.0.0.1:0",
        ],
        tmp_path / "cache",
    )
    assert done.returncode == 1, done.stderr
    assert "meshnode serve: refusing to serve" in done.stderr
    assert "SIGSEGV" in done.stderr and "no setting avoids it" in done.stderr


@pytest.mark.slow
def test_on_an_amx_cpu_repacked_gemma_is_refused_before_it_can_crash_the_node(tmp_path: Path):
    """The real crash, where this machine has it: ``serve --weight-repack on`` refuses with the signal."""
    if known_crash(cpu_features(system_info()), llama_cpp_version()) is None:
        pytest.skip("this CPU and llama.cpp build are not known to crash with repacked weights")
    from engines.default_model import default_model_path

    done = run(
        [sys.executable, "-m", "meshnode", "serve", "--model", str(default_model_path(progress=False)),
         "--api-listen", "127.0.0.1:0", "--weight-repack", "on"],
        tmp_path / "cache",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "in the probe decode" in done.stderr and "start with --weight-repack off" in done.stderr
    assert "SIGILL" in done.stderr or "SIGSEGV" in done.stderr


def test_doctor_runs_the_same_probe_and_prints_the_fix(tmp_path: Path):
    done = run(
        [sys.executable, str(CRASHING), "doctor", "--data-dir", str(tmp_path / "node"),
         "--model", str(ensure_tiny_model()), "--weight-repack", "on", "--listen", "127.0.0.1:0"],
        tmp_path / "cache",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    problem = next(line for line in done.stdout.splitlines() if "engine probe" in line)
    assert problem.startswith("[PROBLEM] engine probe: the engine died of SIGSEGV")
    assert "fix: start with --weight-repack off" in done.stdout


def test_doctor_says_what_auto_chose(tmp_path: Path):
    done = run(
        [sys.executable, "-m", "meshnode", "doctor", "--data-dir", str(tmp_path / "node"),
         "--model", str(ensure_tiny_model()), "--listen", "127.0.0.1:0"],
        tmp_path / "cache",
    )  # fmt: skip
    line = next(line for line in done.stdout.splitlines() if "engine probe" in line)
    assert line.startswith("[ok     ] engine probe: --weight-repack auto: weight repack "), line
    assert "survived a probe decode" in line
