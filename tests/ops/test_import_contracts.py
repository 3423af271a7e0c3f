"""The layering contract in pyproject.toml ([tool.importlinter]) holds, checked by import-linter.

wire -> transport -> membership -> mesh -> dataplane/relaywire -> relaylink -> node -> head ->
api -> app, with no cycles; the relay server depends only on meshnode's lower layers; engines
know nothing of the mesh. A reversed copy of the layers must break, so the check can fail.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-c",
        "import sys, importlinter.cli as c; sys.exit(c.lint_imports_command())",
        str(config),
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_the_layering_contract_is_kept():
    done = lint_imports(REPO / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_contract_the_tree_breaks_is_reported(tmp_path: Path):
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = settings["contracts"][0]["layers"]
    reversed_config = tmp_path / "reversed.ini"
    reversed_config.write_text(
        "[importlinter]\nroot_packages =\n    meshnode\n\n"
        "[importlinter:contract:reversed]\nname = reversed\ntype = layers\nlayers =\n"
        + "".join(f"    {layer}\n" for layer in reversed(layers))
    )
    done = lint_imports(reversed_config)
    assert done.returncode != 0
    assert "BROKEN" in done.stdout
