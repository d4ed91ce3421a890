"""The layers of docs/architecture.md, enforced: import-linter's contracts, no import cycles.

The contracts live in pyproject.toml (``[tool.importlinter]``); by hand:
``lint-imports --no-cache`` from the repository root.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping, Set
from pathlib import Path
from typing import Any

import grimp

from ..conftest import REPO

ROOT_PACKAGES = ("watchdogd", "watchdogd_client")


def _source_path() -> str:
    """The tree under test first, so that no other installed copy is the one analysed."""
    entries = [str(REPO), str(REPO / "client")]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(entries)


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed (it comes with the test extra: import-linter)"
    return found


def _contracts() -> list[dict[str, Any]]:
    with (REPO / "pyproject.toml").open("rb") as file:
        config = tomllib.load(file)["tool"]["importlinter"]
    assert config["include_external_packages"] is True  # or the stdlib bans check nothing
    contracts: list[dict[str, Any]] = config["contracts"]
    return contracts


def test_the_analysed_packages_are_this_tree() -> None:
    for name, where in [("watchdogd", REPO), ("watchdogd_client", REPO / "client")]:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve().is_relative_to(where), (
            f"{name} is imported from {spec.origin}, not from {where}: "
            "the import checks would read another copy"
        )


def test_import_contracts_are_kept() -> None:
    result = subprocess.run(
        [_lint_imports(), "--no-cache"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": _source_path()},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_banned_external_module_is_a_real_one() -> None:
    """import-linter passes over a forbidden external module that is not in the graph, so a
    misspelt name (``prometheus-client``, ``grpcio``) would silently ban nothing."""
    for contract in _contracts():
        for module in contract.get("forbidden_modules", []):
            if module.split(".")[0] in ROOT_PACKAGES:
                continue
            assert "." not in module, f"{contract['name']}: ban the top-level package of {module}"
            assert importlib.util.find_spec(module) is not None, (
                f"{contract['name']}: {module} is no importable module"
            )


def _strongly_connected(edges: Mapping[str, Set[str]]) -> Iterator[list[str]]:
    """Tarjan's algorithm, iteratively: the components with a cycle (two or more modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        yield sorted(component)


def test_strongly_connected_finds_every_cycle_and_nothing_else() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(_strongly_connected(edges)) == [["a", "b", "c"], ["e", "f"]]
    assert list(_strongly_connected({"a": {"b"}, "b": set()})) == []


def test_no_import_cycles_inside_watchdogd() -> None:
    """Module by module, type-checking imports included (as import-linter counts them).

    The ``acyclic_siblings`` contract sees cycles between siblings, at every depth, but not
    between a package and a module inside it; this sees every cycle, naming its imports.
    """
    graph = grimp.build_graph("watchdogd", cache_dir=None)
    edges = {
        module: {m for m in graph.find_modules_directly_imported_by(module) if m in graph.modules}
        for module in graph.modules
    }
    report = []
    for component in _strongly_connected(edges):
        members = set(component)
        report.append(f"a cycle through {len(component)} modules: {', '.join(component)}")
        for importer in component:
            for imported in sorted(edges[importer] & members):
                lines = sorted(
                    detail["line_number"]
                    for detail in graph.get_import_details(importer=importer, imported=imported)
                )
                report.append(f"    {importer} -> {imported} (l.{', '.join(map(str, lines))})")
    assert not report, "\n".join(report)
