"""The test tree's layout: what tests share lives in helper modules, never in another test module.

A test module imported by another runs its module-level setup twice (pytest imports it
once more under its own name) and ties one test's fixtures to another's file. What
more than one test directory uses lives in ``tests/helpers/`` (imported as ``helpers``);
what only one uses stays in that directory, in a module not named ``test_*``. Every
import counts: relative or absolute, ``from . import test_x``, and imports inside
functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# Test directories named like a package of the repository (tests/relay, tests/engines) import
# as that package, so `relay.x` always means the product's.
PRODUCT_PACKAGES = {path.parent.name for path in REPO.glob("*/__init__.py")}


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every import in ``path`` as (relative level, module, names): ``import m`` is (0, "m", [])."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", [alias.name for alias in node.names]))
    return found


def is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def imported_test_modules(path: Path) -> list[str]:
    """The ``test_*`` modules that ``path`` imports, as written (``.test_client``, ``ops.test_x``)."""
    found = []
    for level, module, names in imports(path):
        written = "." * level + module
        if is_test_module(module):
            found.append(written)
        else:  # `from package import test_x` imports the module test_x
            separator = "" if written.endswith(".") or not written else "."
            found += [f"{written}{separator}{name}" for name in names if name.startswith("test_")]
    return found


def other_directories_imported(path: Path, tests: Path = TESTS) -> list[str]:
    """Modules of another test directory than ``path``'s that it imports (``tests/helpers`` aside)."""
    own = path.relative_to(tests).parts[0]
    directories = {d.name for d in tests.iterdir() if d.is_dir()} - {own, "helpers"} - PRODUCT_PACKAGES
    # A plain directory's modules import by their bare names once pytest has put it on sys.path.
    bare_modules = {
        module.stem for d in directories for module in (tests / d).glob("*.py") if module.stem != "__init__"
    }
    return sorted(
        {
            module
            for level, module, _ in imports(path)
            if level == 0 and module.split(".")[0] in directories | bare_modules
        }
    )


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


def test_imports_of_another_test_directory_are_found(tmp_path: Path) -> None:
    for directory in ("head", "dataplane", "mesh", "helpers"):
        (tmp_path / directory).mkdir()
    (tmp_path / "mesh" / "mesh_helpers.py").write_text("")
    sample = tmp_path / "head" / "test_sample.py"
    sample.write_text(
        "from dataplane.chain_fixtures import QuicCluster\n"
        "from mesh_helpers import RawPeer\n"
        "from helpers.polling import eventually\n"
        "from .api_cluster import MODEL\n"
        "import relay.server\n"
    )
    assert other_directories_imported(sample, tmp_path) == ["dataplane.chain_fixtures", "mesh_helpers"]


def test_no_file_under_tests_imports_a_test_module() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50  # the whole tree was read, not an empty folder
    offenders = {
        str(path.relative_to(TESTS)): modules for path in files if (modules := imported_test_modules(path))
    }
    assert offenders == {}, "move what they share into tests/helpers/ or a non-test_ helper module"


def test_test_directories_share_only_through_tests_helpers() -> None:
    files = sorted(path for path in TESTS.rglob("*.py") if path.parent != TESTS)
    offenders = {
        str(path.relative_to(TESTS)): modules
        for path in files
        if (modules := other_directories_imported(path))
    }
    assert offenders == {}, "what more than one test directory uses belongs in tests/helpers/"
