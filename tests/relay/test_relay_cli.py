"""`meshnode relay` (through the CLI registry) and `python -m relay`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.app.cli import main


def test_show_id_creates_a_private_key_once_and_prints_a_stable_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "relay"
    assert main(["relay", "--show-id", "--data-dir", str(data_dir)]) == 0
    first = capsys.readouterr().out.strip()
    assert len(bytes.fromhex(first)) == 32
    (key_file,) = data_dir.iterdir()
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert main(["relay", "--show-id", "--data-dir", str(data_dir)]) == 0
    assert capsys.readouterr().out.strip() == first


def test_help_names_the_relays_own_state_directory(capsys: pytest.CaptureFixture[str]) -> None:
    # The relay's --data-dir help said "node state directory ... ~/.local/share/meshnode",
    # while a relay keeps its key in ~/.local/share/meshnode-relay.
    with pytest.raises(SystemExit):
        main(["relay", "--help"])
    relay_help = " ".join(capsys.readouterr().out.split())
    assert "--data-dir DIR relay state directory, holding its identity key (default" in relay_help
    assert "$MESHNODE_RELAY_DATA_DIR or ~/.local/share/meshnode-relay)" in relay_help
    with pytest.raises(SystemExit):
        main(["join", "--help"])
    join_help = " ".join(capsys.readouterr().out.split())
    assert (
        "--data-dir DIR node state directory (default $MESHNODE_DATA_DIR or ~/.local/share/meshnode)"
        in join_help
    )


def test_relay_needs_a_mesh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["relay", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"]) == 2
    assert "--mesh" in capsys.readouterr().err


def test_a_mistyped_mesh_id_is_refused_not_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A relay started with a typo would refuse every member of the mesh meant, without a word.
    with pytest.raises(SystemExit):
        main(["relay", "--data-dir", str(tmp_path), "--mesh", "7i3pcggwxf4q4yf2s3ejzp5mr"])
    assert (
        "'7i3pcggwxf4q4yf2s3ejzp5mr' is not a mesh id (26 letters and digits 2-7" in capsys.readouterr().err
    )


def test_keepalive_over_the_nat_timeout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["relay", "--data-dir", str(tmp_path), "--mesh", "a" * 26, "--keepalive", "30"])


@pytest.mark.slow
def test_python_m_relay_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay",
            "--listen",
            "127.0.0.1:0",
            "--mesh",
            "a" * 26,
            "--data-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("relay id: ")
        assert process.stdout.readline().startswith("relay listening on 127.0.0.1:")
        process.terminate()
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()


def test_forget_relay_takes_a_relay_id_and_reaches_the_node_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from meshnode.app.cli import build_parser
    from meshnode.app.node_commands import node_config

    relay_id = "ab" * 32
    args = build_parser().parse_args(["start", "--forget-relay", relay_id, "--forget-relay", "cd" * 32])
    assert node_config(args).forget_relays == [bytes.fromhex(relay_id), bytes.fromhex("cd" * 32)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["start", "--forget-relay", "4ceybayaat4r"])
    assert "a relay id is 64 hex digits, got '4ceybayaat4r'" in capsys.readouterr().err
