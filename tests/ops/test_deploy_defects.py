"""What a user copies from the deploy files works: model names agree, the README's `docker run` can
read its invite, and the compose roles hand SIGTERM to meshnode itself."""

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.polling import wait_until

from meshnode.app.cli import build_parser
from meshnode.commandline.config import parse_args_with_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BOOTSTRAP = DEPLOY / "compose" / "bootstrap.sh"

pytestmark = pytest.mark.timeout(60)


def meshnode_args(argv: list[str]):
    return parse_args_with_config(build_parser(), argv, {})


def test_the_compose_files_curl_asks_for_the_model_the_nodes_serve():
    text = (DEPLOY / "compose.yaml").read_text()
    services = yaml.safe_load(text)["services"]
    # A node serves its model under the file's stem (meshnode.app.shard_service.describe_served_model).
    served = {
        Path(meshnode_args(["up", *services[name]["command"][1:]]).model).stem
        for name in ("node1", "node2", "node3")
    }
    asked = re.findall(r'"model":\s*"([^"]+)"', text)
    assert asked and set(asked) == served == {"gemma-3-270m-q4_k_m"}
    # And the file the `model` service writes is the one the nodes load.
    (copy_command,) = services["model"]["command"]
    assert "/models/gemma-3-270m-q4_k_m.gguf" in copy_command


def test_the_compose_api_published_on_the_host_requires_a_key():
    text = (DEPLOY / "compose.yaml").read_text()
    node1 = yaml.safe_load(text)["services"]["node1"]
    assert "8080:8080" in node1["ports"]
    # Compose's `:?` refuses to start without the variable instead of serving an open API.
    assert re.search(r"MESHNODE_API_KEY: \$\{MESHNODE_API_KEY:\?[^}]+\}", text)
    assert "Authorization: Bearer $MESHNODE_API_KEY" in text


def readme_docker_run() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"`(docker run -i [^`]+)`", readme)
    return shlex.split(command)


def test_the_readmes_docker_run_reads_the_invite_mounts_models_and_advertises():
    argv = readme_docker_run()
    assert argv[:3] == ["docker", "run", "-i"]  # without -i, `--invite -` reads an empty stdin
    image = argv.index("meshnode:cpu")
    docker_options, meshnode_argv = argv[:image], argv[image + 1 :]
    volumes = [docker_options[i + 1] for i, arg in enumerate(docker_options) if arg == "-v"]
    assert any(v.split(":")[1] == "/models" for v in volumes)
    assert any(v.split(":")[1] == "/var/lib/meshnode" for v in volumes)
    stdin = meshnode_argv.index("<")
    args = meshnode_args(meshnode_argv[:stdin])
    assert args.command == "up" and args.invite == "-"
    assert str(args.model).startswith("/models/")
    assert args.advertise and args.api_listen == ("0.0.0.0", 8080)
    # An API on every interface gets its key from the environment.
    assert docker_options[docker_options.index("-e") + 1] == "MESHNODE_API_KEY"


STUB = r"""#!/bin/sh
# A stand-in meshnode: records how it was run, and runs until SIGTERM like the real one.
command=$1
if [ "$command" = status ]; then
  [ -s "$STUB_DIR/running" ] || exit 1
  echo '{"node": {"mesh_id": "mesh-from-status"}}'
  exit 0
fi
if [ "$command" = invite ]; then echo "invite-token-$$"; exit 0; fi
if [ "$command" = relay ] && [ "$2" = --show-id ]; then echo relay-id; exit 0; fi
[ "$command" = join ] && read -r token && echo "$token" > "$STUB_DIR/stdin"
trap 'echo TERM > "$STUB_DIR/signal"; exit 0' TERM
echo "$$ $*" > "$STUB_DIR/running"
while :; do sleep 0.05; done
"""


@pytest.mark.parametrize(
    ("role", "expected"),
    [
        ("first", "up --relay relay-id@relay:7448 --layers=0:6"),
        ("member", "join --invite - --layers=0:6"),
        ("relay", "relay --listen 0.0.0.0:7448 --mesh mesh-from-status --layers=0:6"),
    ],
)
def test_each_compose_role_execs_meshnode_so_sigterm_reaches_it(tmp_path, role, expected):
    stub_dir, shared, data_dir = tmp_path / "stub", tmp_path / "bootstrap", tmp_path / "data"
    for path in (stub_dir, shared, data_dir):
        path.mkdir()
    (stub_dir / "meshnode").write_text(STUB)
    (stub_dir / "meshnode").chmod(0o755)
    (shared / "relay_id").write_text("relay-id\n")
    (shared / "mesh_id").write_text("mesh-from-status\n")
    (shared / "invite-stubhost").write_text("the-invite-token\n")
    env = {
        **os.environ,
        "PATH": f"{stub_dir}:{os.environ['PATH']}",
        "STUB_DIR": str(stub_dir),
        "MESHNODE_BOOTSTRAP_DIR": str(shared),
        "MESHNODE_DATA_DIR": str(data_dir),
        "MESHNODE_MEMBERS": "node2 node3",
        # The member role finds its invite by hostname; `hostname` is stubbed too.
    }
    (stub_dir / "hostname").write_text("#!/bin/sh\necho stubhost\n")
    (stub_dir / "hostname").chmod(0o755)
    if role == "first":
        (shared / "mesh_id").unlink()  # the first node publishes it
    process = subprocess.Popen(["sh", str(BOOTSTRAP), role, "--layers=0:6"], env=env)
    try:
        running = wait_until(lambda: (stub_dir / "running").exists() and (stub_dir / "running").read_text())
        pid, _, argv = running.strip().partition(" ")
        assert argv == expected
        # exec: meshnode is the process the container runtime signals, not a child of a shell.
        assert int(pid) == process.pid
        if role == "first":
            assert wait_until(
                lambda: (shared / "invite-node3").exists() and (shared / "invite-node3").read_text()
            )
            assert (shared / "invite-node2").read_text().startswith("invite-token-")
            assert (shared / "mesh_id").read_text().strip() == "mesh-from-status"
        if role == "member":
            assert (stub_dir / "stdin").read_text().strip() == "the-invite-token"
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert (stub_dir / "signal").read_text().strip() == "TERM"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
