"""The deploy files parse, name real commands and options, and pass systemd's own verifier."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshnode.app.cli import build_parser
from meshnode.commandline.config import ConfigError, parse_args_with_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# What each bootstrap.sh role runs (deploy/compose/bootstrap.sh).
ROLE_COMMANDS = {"first": "up", "member": "join", "relay": "relay"}


def meshnode_args(argv: list[str]):
    return parse_args_with_config(build_parser(), argv, {})


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_runs_a_relay_and_three_nodes_covering_the_model():
    services = compose()["services"]
    assert {"relay", "node1", "node2", "node3", "model"} <= set(services)
    ranges = []
    for name in ("node1", "node2", "node3"):
        role, *options = services[name]["command"]
        args = meshnode_args([ROLE_COMMANDS[role], *options])
        assert str(args.model).endswith(".gguf")
        ranges.append(args.layers)
        mounts = {v.split(":")[1] for v in services[name]["volumes"]}
        assert {"/bootstrap", "/models", "/var/lib/meshnode"} <= mounts
    assert sorted(ranges) == [(0, 6), (6, 12), (12, 18)]
    assert meshnode_args(["relay"]).listen.endswith(":7448")
    assert "8080:8080" in services["node1"]["ports"]
    declared = set(compose()["volumes"])
    used = {v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if not v.startswith(".")}
    assert used <= declared


def test_bootstrap_script_is_valid_shell_with_every_role():
    script = DEPLOY / "compose" / "bootstrap.sh"
    assert script.stat().st_mode & 0o111
    subprocess.run(["sh", "-n", str(script)], check=True)
    text = script.read_text()
    for role in ROLE_COMMANDS:
        assert re.search(rf"^\s+{role}\)", text, re.MULTILINE)


def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
        else:
            key, _, value = line.partition("=")
            sections[current].append((key, value))
    return sections


@pytest.mark.parametrize(
    ("unit", "user", "command"),
    [("meshnode.service", "meshnode", "start"), ("meshnode-relay.service", "meshnode-relay", "relay")],
)
def test_units_run_as_a_dedicated_user_with_a_private_data_directory(unit, user, command):
    sections = unit_entries(DEPLOY / "systemd" / unit)
    service = dict(sections["Service"])
    assert service["User"] == user
    assert service["StateDirectoryMode"] == "0700"
    exec_start = service["ExecStart"].split()
    assert exec_start[0].endswith("/meshnode") and exec_start[1] == command
    meshnode_args(exec_start[1:])
    assert sections["Install"] == [("WantedBy", "multi-user.target")]
    sysusers = (DEPLOY / "systemd" / "meshnode.sysusers.conf").read_text()
    assert re.search(rf"^u {user} ", sysusers, re.MULTILINE)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", ["meshnode.service", "meshnode-relay.service"])
def test_units_pass_systemd_analyze_verify(tmp_path, unit):
    # Point ExecStart at this checkout's meshnode: verify insists the binary exists.
    installed = Path(sys.executable).with_name("meshnode")
    text = (DEPLOY / "systemd" / unit).read_text().replace("/opt/meshnode/bin/meshnode", str(installed))
    (tmp_path / unit).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Failed" not in result.stderr


def test_example_config_is_accepted_for_nodes_and_the_relay(tmp_path):
    example = str(DEPLOY / "meshnode.example.toml")
    node = meshnode_args(["start", "--config", example])
    assert (node.listen, node.layers, node.log_format) == ("0.0.0.0:7447", (0, 9), "json")
    # The relay's mesh is a placeholder it refuses until replaced, naming what a mesh id is.
    with pytest.raises(ConfigError, match=r"'replace-with-your-mesh-id' is not a mesh id"):
        meshnode_args(["relay", "--config", example])
    mesh_id = "x3v5bmazmzs72uyh2v3mb4pe7q"
    replaced = tmp_path / "meshnode.toml"
    replaced.write_text(
        (DEPLOY / "meshnode.example.toml").read_text().replace("replace-with-your-mesh-id", mesh_id)
    )
    relay = meshnode_args(["relay", "--config", str(replaced)])
    assert (relay.listen, relay.mesh) == ("0.0.0.0:7448", [mesh_id])


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_build_from_this_tree_and_run_meshnode(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 2  # build stage + slim runtime
    copied: set[str] = set()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE):
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), source
            copied.add(source)
    # What `pip wheel .` reads: the metadata, the extension's build script, the packages.
    assert {"pyproject.toml", "setup.py", "README.md", "meshnode", "relay", "engines"} <= copied
    assert 'ENTRYPOINT ["meshnode"]' in text
    assert "USER meshnode" in text
    if dockerfile.endswith("cuda"):
        assert "-DGGML_CUDA=on" in text
