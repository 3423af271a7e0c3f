"""`meshnode doctor` names each problem of a broken environment and how to fix it."""

import os
import socket
import subprocess
import sys

import pytest
from helpers.node_processes import NodeProcess
from helpers.polling import wait_until

from engines.tiny_model import ensure_tiny_model
from meshnode.identity import NODE_KEY_FILE, load_or_create_identity


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model():
    return ensure_tiny_model()


def test_a_healthy_environment_passes(tmp_path, tiny_model):
    load_or_create_identity(tmp_path / "node")
    result = doctor(
        "--data-dir",
        str(tmp_path / "node"),
        "--model",
        str(tiny_model),
        "--layers",
        "0:3",
        "--listen",
        f"127.0.0.1:{free_udp_port()}",
    )
    assert result.returncode == 0, result.stdout
    assert "no problems found" in result.stdout
    assert "model fingerprint: manifest root" in result.stdout


def test_every_problem_is_named_with_its_fix(tmp_path, tiny_model):
    data_dir = tmp_path / "node"
    load_or_create_identity(data_dir)
    os.chmod(data_dir / NODE_KEY_FILE, 0o644)
    os.chmod(data_dir, 0o777)
    broken_model = tmp_path / "broken.gguf"
    broken_model.write_bytes(b"GGUF" + b"\xff" * 64)
    busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    dead_relay = "cd" * 32 + f"@127.0.0.1:{free_udp_port()}"
    try:
        result = doctor(
            "--data-dir",
            str(data_dir),
            "--model",
            str(broken_model),
            "--n-gpu-layers",
            "8",
            "--listen",
            f"127.0.0.1:{busy.getsockname()[1]}",
            "--relay",
            dead_relay,
            "--timeout",
            "1",
        )
    finally:
        busy.close()
    out = result.stdout
    assert result.returncode == 1
    problems = [line for line in out.splitlines() if line.startswith("[PROBLEM]")]
    assert any("is writable by others" in p for p in problems)
    assert any(f"{NODE_KEY_FILE} is readable by others" in p for p in problems)
    assert any("broken.gguf is not a readable GGUF file" in p for p in problems)
    assert any("GPU offload" in p and "CPU-only" in p for p in problems)
    assert any("QUIC port" in p and "cannot bind" in p for p in problems)
    assert any("relay 127.0.0.1" in p and "not reachable" in p for p in problems)
    assert out.count("fix: ") >= len(problems)
    assert f"{len(problems)} problem(s) found" in out


def test_missing_pieces_and_a_bad_layer_range(tmp_path, tiny_model):
    result = doctor(
        "--data-dir",
        str(tmp_path / "nowhere"),
        "--model",
        str(tiny_model),
        "--layers",
        "2:99",
        "--listen",
        f"127.0.0.1:{free_udp_port()}",
    )
    assert result.returncode == 1
    assert "nowhere not made yet (meshnode init, create or join makes it)" in result.stdout
    assert "2:99 is outside the model's 0:6" in result.stdout
    missing = doctor("--data-dir", str(tmp_path), "--model", str(tmp_path / "none.gguf"))
    assert "none.gguf does not exist" in missing.stdout


def test_a_data_directory_that_cannot_be_made_is_a_problem(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = doctor("--data-dir", str(blocker / "data"), "--listen", f"127.0.0.1:{free_udp_port()}")
    assert result.returncode == 1
    assert f"{blocker / 'data'} does not exist and {blocker} is not a writable directory" in result.stdout


@pytest.mark.parametrize(
    "in_use, built, severity, words",
    [
        (True, True, "OK", "AVX2 + VPCLMULQDQ extension"),
        (False, True, "OK", "this CPU lacks AVX2 + VPCLMULQDQ"),
        (False, False, "WARNING", "was not built"),
    ],
)
def test_the_checksum_implementation_is_named(monkeypatch, in_use, built, severity, words):
    from meshnode.app import doctor as doctor_module
    from meshnode.wire import crc32c

    monkeypatch.setattr(crc32c, "simd_in_use", lambda: in_use)
    monkeypatch.setattr(crc32c, "simd_built", lambda: built)
    (finding,) = doctor_module.check_checksum()
    assert finding.severity is doctor_module.Severity[severity]
    assert words in finding.detail
    assert bool(finding.fix) == (severity == "WARNING")


@pytest.mark.parametrize("native", [True, False])
def test_the_hidden_capture_callback_is_named(monkeypatch, native):
    from meshnode.app import doctor as doctor_module

    monkeypatch.setattr(doctor_module, "capture_in_use", lambda: native)
    (finding,) = doctor_module.check_capture()
    assert finding.severity is (doctor_module.Severity.OK if native else doctor_module.Severity.WARNING)
    assert ("C eval callback" in finding.detail) and (("not built" in finding.detail) != native)
    assert bool(finding.fix) != native


def test_a_running_node_is_shown_with_the_addresses_it_really_uses(tmp_path):
    """Doctor is often run without the options the node was started with: it reports the
    running node's own addresses, not its default port as free or busy."""
    node = NodeProcess(tmp_path, "n")
    node.start("create", "--listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--placement", "off")
    try:
        status = wait_until(node.live_status, timeout=60, what="the node answers status")
        advertised = status["node"]["addresses"][0]
        result = doctor("--data-dir", str(node.data_dir))
    finally:
        node.stop()
    lines = result.stdout.splitlines()
    assert f"[ok     ] QUIC port: in use by the running node, which advertises {advertised}" in lines
    assert "[ok     ] API port: the running node serves no API" in lines  # --placement off: no layers
    assert "7447" not in result.stdout
