"""The engine's shape (issue 18 item 2): its import graph has no cycle, TYPE_CHECKING imports included,
and no schedule imports engine/engine.py, so a schedule only knows the parts it gets (engine/parts.py).
The planner's import graph has no cycle either (issue 18: no lazy import to hide one)."""

from __future__ import annotations

import ast
import pathlib
from types import ModuleType

import pytest

import lightning_zero_offload.engine as engine_package
import lightning_zero_offload.planner as planner_package

PACKAGE = "lightning_zero_offload.engine"


def package_imports(package: ModuleType = engine_package) -> dict[str, set[str]]:
    """Every module of ``package`` -> the package's modules it imports (anywhere in the file)."""
    root = pathlib.Path(package.__file__).parent

    def module(path: pathlib.Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join((package.__name__, *(parts[:-1] if parts[-1] == "__init__" else parts)))

    modules = {module(path): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
                found = next((t for t in targets if t in modules), None)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


@pytest.mark.parametrize(("package", "hub"), [(engine_package, "engine"), (planner_package, "model")])
def test_the_package_has_no_import_cycle(package, hub):
    graph = package_imports(package)
    assert f"{package.__name__}.{hub}" in graph and graph[f"{package.__name__}.{hub}"]  # the walk sees imports
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join((*path[path.index(name) :], name)))
        if name in done:
            return
        for target in graph[name]:
            visit(target, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_no_schedule_imports_the_engine():
    graph = package_imports()
    schedules = [name for name in graph if name.startswith(f"{PACKAGE}.schedules")]
    assert len(schedules) >= 4
    assert [name for name in schedules if f"{PACKAGE}.engine" in graph[name]] == []
    assert all(f"{PACKAGE}.engine" not in graph[name] for name in (f"{PACKAGE}.update", f"{PACKAGE}.state"))
