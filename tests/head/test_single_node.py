"""Whole-model single-node mode: ``meshnode serve`` answers the API alone; ``meshnode generate`` streams it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.serve_process import serve_data_dir, serving_process, whole_model_greedy_text

from engines.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = "hello world, the mesh"
TOKENS = 16


def meshnode(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", *args], capture_output=True, text=True, timeout=60, **kwargs
    )


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def serve_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="module")
def serving(serve_log: Path, tiny_model: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    with serving_process(serve_log, tiny_model) as served:
        yield served


def reference_text(model: Path) -> str:
    return whole_model_greedy_text(model, PROMPT, TOKENS)


def test_serve_answers_with_the_whole_model_and_generate_streams_it(serving, tiny_model):
    url, _ = serving
    done = meshnode(
        "generate", "--api", url, "--prompt", PROMPT, "--max-tokens", str(TOKENS), "--temperature", "0"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference_text(tiny_model) + "\n"
    assert f"{TOKENS} tokens (length)" in done.stderr


def test_generate_reads_the_prompt_from_stdin_and_reports_api_errors(serving):
    url, _ = serving
    done = meshnode("generate", "--api", url, "--max-tokens", "3", "--quiet", input="hello")
    assert done.returncode == 0 and done.stderr == ""
    done = meshnode("generate", "--api", url, "--prompt", "x", "--model", "other")
    assert done.returncode == 1
    assert "404: model 'other' is not served here" in done.stderr


def test_generate_without_a_running_node_says_so(tmp_path):
    done = meshnode("generate", "--data-dir", str(tmp_path), "--prompt", "hello")
    assert done.returncode == 1
    assert f"no node running on {tmp_path}" in done.stderr
    done = meshnode("generate", "--api", "http://127.0.0.1:9", "--prompt", "hello")
    assert done.returncode == 1 and "no API answers at http://127.0.0.1:9" in done.stderr


def test_serve_refuses_a_missing_model_and_a_disabled_api(tmp_path):
    done = meshnode("serve", "--model", str(tmp_path / "none.gguf"))
    assert done.returncode == 2 and "no model file at" in done.stderr
    done = meshnode("serve", "--model", str(tmp_path / "none.gguf"), "--api-listen", "off")
    assert done.returncode == 2 and "makes no sense" in done.stderr
    # A file that is not a GGUF: one line saying so, before anything sizes or loads it.
    (tmp_path / "notes.gguf").write_text("not a model\n")
    done = meshnode("serve", "--model", str(tmp_path / "notes.gguf"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"meshnode serve: cannot read GGUF {tmp_path / 'notes.gguf'}: {tmp_path / 'notes.gguf'} is not a GGUF file (bad magic)"
    ]


def test_serve_exposes_metrics_without_mesh_families(serving):
    import urllib.request

    url, _ = serving
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {"meshnode_up", "meshnode_sessions_active", "meshnode_tokens_generated_total"} <= names
    assert "meshnode_peers" not in names  # no mesh in single-node mode


def test_status_and_generate_find_a_standalone_server_through_its_data_directory(
    serving, serve_log, tiny_model
):
    url, _ = serving
    data_dir = str(serve_data_dir(serve_log))
    shown = meshnode("status", "--data-dir", data_dir)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("standalone server (meshnode serve: no mesh), up ")
    assert lines[1].startswith(f"  serving: {tiny_model.stem} [0:6) of 6 (")
    sessions = re.search(r"  sessions 0/(\d+)$", lines[1])
    assert sessions, lines[1]
    assert lines[2] == f"  API: {url}/v1 (try: meshnode generate --prompt ...)"
    assert lines[3].startswith("  memory: ") and "against its budget" in lines[3]
    # The prefix cache is on by default and may keep as many prefixes as the shard has sessions.
    kept = re.fullmatch(
        r"  prefix cache: \d+ of (\d+) kept; \d+ hits, \d+ misses, \d+ tokens reused", lines[4]
    )
    assert kept and kept.group(1) == sessions.group(1), lines[4]
    raw = json.loads(meshnode("status", "--data-dir", data_dir, "--json").stdout)
    assert raw["standalone"]["api_url"] == url and "node" not in raw
    # `generate` with no --api finds the server's API as it finds a node's.
    done = meshnode(
        "generate",
        "--data-dir",
        data_dir,
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(TOKENS),
        "--temperature",
        "0",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference_text(tiny_model) + "\n"
    # `doctor` tells a server from a node (tests/ops/test_standalone_status.py: the other commands).
    doctor = meshnode("doctor", "--data-dir", data_dir)
    assert "node: not running (a standalone `meshnode serve` answers on this data directory)" in doctor.stdout


def test_serve_stops_cleanly_on_sigterm(serving, serve_log):
    _, process = serving
    process.send_signal(signal.SIGTERM)
    assert process.wait(20) == 0
    # Its status socket goes with it.
    assert not (serve_data_dir(serve_log) / "control.sock").exists()


def test_a_mesh_node_serving_every_layer_answers_alone(tmp_path, tiny_model):
    """``meshnode create --model PATH`` without --layers: a one-hop route to itself, same driver."""
    from meshnode.statussocket.client import query_status

    data_dir = tmp_path / "solo"
    log = tmp_path / "solo.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "meshnode", "create", "--data-dir", str(data_dir), "--listen",
             "127.0.0.1:0", "--model", str(tiny_model), "--api-listen", "127.0.0.1:0", "--threads", "1",
             "--ctx", "512", "--prefix-cache", "off"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if query_status(data_dir, timeout=1.0)["node"]["api_url"]:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        done = meshnode(
            "generate", "--data-dir", str(data_dir), "--prompt", PROMPT, "--max-tokens", str(TOKENS),
            "--temperature", "0",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + log.read_text()
        assert done.stdout == reference_text(tiny_model) + "\n"
        status = meshnode("status", "--data-dir", str(data_dir))
        assert "API: http://127.0.0.1:" in status.stdout
        # Off: the shard keeps nothing of released sessions, and its status says so.
        assert "  prefix cache: off" in status.stdout.splitlines()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(20)
