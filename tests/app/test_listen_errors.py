"""A port someone else holds: ``create``, ``join``/``start`` and ``relay`` say which port, which
protocol and which option chooses another, in one line, and ``create`` writes no mesh that the
corrected command would then find in its way."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers.mesh_nodes import fast_config, first_member

from meshnode.app.cli import build_parser
from meshnode.app.lifecycle import run_node
from meshnode.app.listen_check import bind_problem, required_api_address
from meshnode.commandline.cli_error import CliError
from meshnode.membership.credentials import MeshKey
from meshnode.membership.store import DataDir

pytestmark = pytest.mark.timeout(60)

IN_USE = "the address is already in use"


def meshnode(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshnode", *args], capture_output=True, text=True, timeout=50, check=False
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def busy_udp() -> Iterator[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as holder:
        holder.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{holder.getsockname()[1]}"


@pytest.fixture
def busy_tcp() -> Iterator[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"127.0.0.1:{holder.getsockname()[1]}"


def test_create_on_a_busy_quic_port_names_it_and_writes_no_mesh(tmp_path, busy_udp):
    data_dir = tmp_path / "c"
    result = meshnode("create", "--data-dir", str(data_dir), "--listen", busy_udp, "--api-listen", "off")
    assert result.returncode == 1
    assert one_line_error(result) == (
        f"meshnode create: cannot listen on UDP {busy_udp}: {IN_USE} (another meshnode, or another "
        "program, listens there); choose another with --listen HOST:PORT (port 0 picks a free one)"
    )
    assert not DataDir(data_dir).has_membership()


def test_create_on_a_busy_api_port_names_it_and_writes_no_mesh(tmp_path, busy_tcp):
    data_dir = tmp_path / "c"
    result = meshnode(
        "create", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", "--api-listen", busy_tcp
    )
    assert result.returncode == 1
    error = one_line_error(result)
    assert f"cannot listen on TCP {busy_tcp}: {IN_USE}" in error and "--api-listen" in error
    assert not DataDir(data_dir).has_membership()


def test_a_relay_on_a_busy_port_names_it(tmp_path, busy_udp):
    result = meshnode("relay", "--data-dir", str(tmp_path / "r"), "--listen", busy_udp, "--mesh", "a" * 26)
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"meshnode relay: cannot listen on UDP {busy_udp}: {IN_USE}")
    assert "Traceback" not in result.stderr


async def test_a_port_taken_after_the_check_is_a_one_line_error_not_a_traceback(tmp_path, busy_udp):
    node = first_member(tmp_path / "n", fast_config(listen=busy_udp), MeshKey.generate())
    with pytest.raises(CliError, match=f"cannot listen on UDP {busy_udp}: {IN_USE}.*--listen"):
        await run_node(node)


def test_an_address_this_machine_lacks_is_named_as_such():
    # 192.0.2.0/24 is reserved for documentation: no machine has it.
    problem = bind_problem(socket.SOCK_DGRAM, "192.0.2.1", 0)
    assert problem is not None
    assert str(problem) == "cannot listen on UDP 192.0.2.1:0: this machine has no such address"
    assert bind_problem(socket.SOCK_DGRAM, "127.0.0.1", 0) is None


def test_only_an_api_address_given_on_the_command_line_must_be_free():
    # Several nodes on one machine share the default API port: the later ones warn and run
    # without the API, so only an address the person chose is refused when busy.
    parser = build_parser()
    given = parser.parse_args(["join", "--api-listen", "127.0.0.1:9", "--model", "m.gguf"])
    assert required_api_address(given) == ("127.0.0.1", 9)
    assert required_api_address(parser.parse_args(["join", "--model", "m.gguf"])) is None
    assert required_api_address(parser.parse_args(["join", "--api-listen", "off"])) is None
    # A member that serves no layers and takes none serves no API either.
    idle = parser.parse_args(["join", "--api-listen", "127.0.0.1:9", "--placement", "off"])
    assert required_api_address(idle) is None
