"""The import contracts in pyproject.toml ([tool.importlinter]) hold, checked by import-linter.

One stack, each layer importing only those below it: the app; the engine backends (llama.cpp,
the fake, the tokenizer), which only the app composes; api; head and placement; llama.cpp's view
of the devices, which placement sizes a range to; node; traversal; relaylink; dataplane,
relaywire, artifacts; mesh; the command-line plumbing and the status socket both programs share;
membership; transport; wire and the core modules; and at the foot the contract between the mesh
and an engine (engines.interface and its kin) with the model files every layer may read. Every engines module has its place there. Beside it: the relay server
depends only on meshnode's lower layers, the engines know nothing of the mesh, nothing below
the app imports the relay server, and the sans-IO modules import no asyncio, socket or
selectors (through any chain of imports; the graph holds the standard library for that). The
data plane's layout tells which is which: its asyncio edges live in meshnode.dataplane.edges,
and every other module of it is on the sans-IO list.

Each kind of contract is shown able to fail: the stack reversed, the engines' layers reversed,
and the sans-IO contract given a module that reads frames with asyncio.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import grimp

REPO = Path(__file__).resolve().parents[2]
SETTINGS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-c",
        "import sys, importlinter.cli as c; sys.exit(c.lint_imports_command())",
        str(config),
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def contract(name: str) -> dict[str, Any]:
    (found,) = [each for each in SETTINGS["contracts"] if each["name"] == name]
    return found


def layers_contract() -> dict[str, Any]:
    (found,) = [each for each in SETTINGS["contracts"] if each["type"] == "layers"]
    return found


def layer_modules(layer: str) -> list[str]:
    """The modules of one layer as written (``a | b`` or ``a : b``, over several lines or one)."""
    return [name.strip() for name in re.split(r"[|:]", layer)]


def ini_config(path: Path, fields: dict[str, str | list[str]]) -> Path:
    """A one-contract import-linter configuration over this tree's root packages, as an INI file."""

    def lines(value: str | list[str]) -> str:
        if isinstance(value, str):
            return f" {value}\n"
        # One item a line; a layer written over several lines in pyproject.toml becomes one.
        return "\n" + "".join(f"    {' '.join(item.split())}\n" for item in value)

    text = "[importlinter]\nroot_packages =" + lines(SETTINGS["root_packages"])
    text += f"include_external_packages = {SETTINGS.get('include_external_packages', False)}\n\n"
    text += "[importlinter:contract:copy]\n" + "".join(
        f"{key} ={lines(value)}" for key, value in fields.items()
    )
    path.write_text(text)
    return path


def test_the_contracts_are_kept():
    done = lint_imports(REPO / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(SETTINGS['contracts'])} kept, 0 broken" in done.stdout


def test_every_engines_module_has_a_place_in_the_stack():
    placed = {name for layer in layers_contract()["layers"] for name in layer_modules(layer)}
    graph = grimp.build_graph("engines", cache_dir=None)
    assert graph.modules - {"engines"} == {name for name in placed if name.startswith("engines.")}


def test_every_data_plane_module_is_a_machine_under_the_sans_io_contract_or_an_edge():
    """The data plane's layout tells the runtime: its asyncio edges live in meshnode.dataplane.edges,
    and every other module of it is a machine the sans-IO contract covers."""
    sans_io = set(contract("the sans-IO modules import no asyncio, socket or selectors")["source_modules"])
    graph = grimp.build_graph("meshnode", cache_dir=None)
    machines = {m for m in graph.find_descendants("meshnode.dataplane") if m.count(".") == 2}
    machines.discard("meshnode.dataplane.edges")
    assert machines == {m for m in sans_io if m.startswith("meshnode.dataplane.")}
    edges = graph.find_descendants("meshnode.dataplane.edges")
    assert "meshnode.dataplane.edges.shard_session" in edges and not edges & sans_io


def test_a_contract_the_tree_breaks_is_reported(tmp_path: Path):
    reversed_layers = list(reversed(layers_contract()["layers"]))
    done = lint_imports(
        ini_config(
            tmp_path / "reversed.ini", {"name": "reversed", "type": "layers", "layers": reversed_layers}
        )
    )
    assert done.returncode != 0
    assert "BROKEN" in done.stdout


def test_the_engines_layers_reversed_are_reported(tmp_path: Path):
    engine_layers = [layer for layer in layers_contract()["layers"] if layer.lstrip().startswith("engines.")]
    assert len(engine_layers) == 3
    config = ini_config(
        tmp_path / "engines.ini",
        {"name": "engines reversed", "type": "layers", "layers": engine_layers[::-1]},
    )
    done = lint_imports(config)
    assert done.returncode != 0
    # The backends use the contract at the foot: the reversed order forbids exactly that.
    assert re.search(r"engines\.\w+ is not allowed to import engines\.interface", done.stdout), done.stdout


def test_the_sans_io_contract_is_reported_for_a_module_that_awaits(tmp_path: Path):
    sans_io = contract("the sans-IO modules import no asyncio, socket or selectors")
    config = ini_config(
        tmp_path / "sans_io.ini",
        {
            "name": "sans-IO with an asyncio edge",
            "type": "forbidden",
            "source_modules": [*sans_io["source_modules"], "meshnode.transport.frame_reader"],
            "forbidden_modules": sans_io["forbidden_modules"],
        },
    )
    done = lint_imports(config)
    assert done.returncode != 0
    assert "meshnode.transport.frame_reader is not allowed to import asyncio" in done.stdout


def test_the_standard_library_is_in_the_graph_as_external_modules():
    """What the sans-IO contract relies on: with include_external_packages, asyncio and socket are
    modules of the graph (one each, squashed) that a chain of imports can reach."""
    assert SETTINGS["include_external_packages"] is True
    graph = grimp.build_graph("meshnode", include_external_packages=True, cache_dir=None)
    for name in ("asyncio", "socket"):
        assert name in graph.modules
        assert graph.is_module_squashed(name)
    assert "asyncio" in graph.find_modules_directly_imported_by("meshnode.transport.frame_reader")
    assert graph.find_shortest_chain("meshnode.mesh.message_reader", "asyncio") is not None
