"""The test tree's layout: what tests share lives in helper modules, never in another test module.

A test module imported by another runs its module-level setup twice (pytest imports it
once more under its own name) and ties one test's fixtures to another's file; what is
shared belongs in ``tests/helpers/`` or a directory's non-``test_`` helper module.
Every import counts: relative or absolute, ``from . import test_x``, and imports
inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imported_test_modules(path: Path) -> list[str]:
    """The ``test_*`` modules that ``path`` imports, as written (``.test_client``, ``ops.test_x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if is_test_module(module):
                found.append(module)
                continue
            # `from package import test_x` imports the module test_x.
            separator = "" if module.endswith(".") else "."
            found += [f"{module}{separator}{a.name}" for a in node.names if a.name.startswith("test_")]
    return found


def test_test_to_test_imports_are_found_however_they_are_written(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "from . import test_mesh_acceptance as acceptance\n"
        "from .test_client import reference\n"
        "import ops.test_app_layer\n"
        "from helpers.polling import eventually\n"
        "def later():\n"
        "    from dataplane.test_service import AnnouncingPeer\n"
    )
    assert imported_test_modules(sample) == [
        ".test_mesh_acceptance",
        ".test_client",
        "ops.test_app_layer",
        "dataplane.test_service",
    ]


def test_no_file_under_tests_imports_a_test_module() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50  # the whole tree was read, not an empty folder
    offenders = {
        str(path.relative_to(TESTS)): modules for path in files if (modules := imported_test_modules(path))
    }
    assert offenders == {}, "move what they share into tests/helpers/ or a non-test_ helper module"
