"""The application layer is the top: nothing below ``meshnode.app`` imports it, and the head
does not import the API that serves it. Every import statement counts, function-local ones too,
so a cycle cannot hide inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# ``python -m meshnode`` and ``python -m relay`` start the application: they are its entry points.
ENTRY_POINTS = {"meshnode/__main__.py", "relay/__main__.py"}


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names (``from a import b`` names ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def importers_of(package: str, under: list[str]) -> list[str]:
    found = []
    for top in under:
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if any(name == package or name.startswith(package + ".") for name in imported_modules(path)):
                found.append(relative)
    return found


def test_nothing_below_the_app_layer_imports_it():
    importers = importers_of("meshnode.app", ["meshnode", "relay", "engines"])
    below = [path for path in importers if not path.startswith("meshnode/app/")]
    assert set(below) == ENTRY_POINTS


def test_the_head_does_not_import_the_api_or_the_app():
    assert importers_of("meshnode.api", ["meshnode/head"]) == []
    assert importers_of("meshnode.app", ["meshnode/head", "meshnode/api"]) == []
