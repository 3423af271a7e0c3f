"""No import cycle, between modules or between packages, counting every import there is.

The graph is grimp's (what import-linter checks the contracts on), built from the source: it holds
the imports inside functions and under ``if TYPE_CHECKING:`` as well as the module-level ones, so
a cycle cannot hide behind a deferred import. A cycle is a strongly connected component of more
than one node, found by :func:`cycles`.

At the package level each module counts as its package: for ``meshnode``, a package of packages,
the part under the root (``meshnode.app``, ``meshnode.dataplane``, ``meshnode.sansio``); ``engines``
and ``relay`` are flat and count as one package each. A package's own modules importing each
other is no package cycle (the module-level check covers them). An entry point (``__main__``)
counts as its package like any other module: ``python -m relay`` runs ``relay.command``, inside
the relay, so the relay imports no app to run. Nothing imports an entry point (checked here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT_PACKAGES = ("meshnode", "relay", "engines")
# Roots whose modules all count as the root's one package.
FLAT_ROOTS = frozenset({"engines", "relay"})

Graph = Mapping[str, Iterable[str]]


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan's, without
    recursion), each sorted, in name order. ``graph`` maps a node to those it imports."""
    nodes = sorted(set(graph) | {target for targets in graph.values() for target in targets})
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = lowest[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = lowest[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    lowest[node] = min(lowest[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowest[parent] = min(lowest[parent], lowest[node])
            if lowest[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] in FLAT_ROOTS else ".".join(parts[:2])


def module_graph(*roots: str) -> dict[str, set[str]]:
    """Each module of ``roots`` and those of ``roots`` it imports, wherever the import stands
    (grimp keeps TYPE_CHECKING imports unless told otherwise; no cache, so never stale)."""
    graph = grimp.build_graph(*roots, include_external_packages=False, cache_dir=None)
    return {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}


def package_graph(modules: Graph) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for importer, imported in modules.items():
        targets = packages.setdefault(package_of(importer), set())
        targets.update(package_of(target) for target in imported)
        targets.discard(package_of(importer))
    return packages


@pytest.fixture(scope="module")
def imports() -> dict[str, set[str]]:
    return module_graph(*ROOT_PACKAGES)


def test_no_two_modules_import_each_other_however_indirectly(imports: dict[str, set[str]]) -> None:
    assert len(imports) > 200  # the whole tree was read
    assert cycles(imports) == []


def test_no_two_packages_import_each_other_however_indirectly(imports: dict[str, set[str]]) -> None:
    packages = package_graph(imports)
    assert {"meshnode.app", "meshnode.transport", "engines", "relay"} <= set(packages)
    assert cycles(packages) == []


def test_nothing_imports_an_entry_point(imports: dict[str, set[str]]) -> None:
    entry_points = {module for module in imports if module.endswith(".__main__")}
    assert entry_points == {"meshnode.__main__", "relay.__main__"}
    assert {module for module, imported in imports.items() if imported & entry_points} == set()


def test_the_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),
        "f": {"f", "g"},  # a module importing itself is no cycle between modules
        "g": {"h"},
        "h": {"g"},  # g <-> h
    }
    assert cycles(graph) == [["a", "b", "c"], ["g", "h"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_a_package_cycle_is_one_between_packages_not_inside_one() -> None:
    modules = {
        "meshnode.app.cli": {"meshnode.app.status", "relay.server"},
        "meshnode.app.status": {"meshnode.app.cli"},  # inside meshnode.app: a module cycle only
        "relay.server": {"meshnode.wire.framing"},
        "relay.__main__": {"relay.command"},
        "relay.command": {"relay.server", "meshnode.commandline.config"},
        "meshnode.commandline.config": set(),
        "meshnode.wire.framing": set(),
    }
    assert cycles(package_graph(modules)) == []
    looped = {**modules, "meshnode.wire.framing": {"relay.core"}}
    assert cycles(package_graph(looped)) == [["meshnode.wire", "relay"]]
    # An entry point is its package: the relay's running the app closes a cycle.
    entered_through_the_app = {**modules, "relay.__main__": {"meshnode.app.cli"}}
    assert cycles(package_graph(entered_through_the_app)) == [["meshnode.app", "relay"]]


def test_the_graph_counts_imports_in_functions_and_for_type_checking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "cyclesample"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from cyclesample.second import Second\n"
    )
    (package / "second.py").write_text("def later():\n    from cyclesample import third\n")
    (package / "third.py").write_text("import cyclesample.first\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles(module_graph("cyclesample")) == [
        ["cyclesample.first", "cyclesample.second", "cyclesample.third"]
    ]
