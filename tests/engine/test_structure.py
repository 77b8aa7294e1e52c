"""The engine's shape (issue 18 item 2): its import graph has no cycle, TYPE_CHECKING imports included,
and no schedule imports engine/engine.py, so a schedule only knows the parts it gets (engine/parts.py)."""

from __future__ import annotations

import ast
import pathlib

import lightning_zero_offload.engine as engine_package

ROOT = pathlib.Path(engine_package.__file__).parent
PACKAGE = "lightning_zero_offload.engine"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def engine_imports() -> dict[str, set[str]]:
    """Every module of the engine package -> the package's modules it imports (anywhere in the file)."""
    modules = {_module(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
                found = next((t for t in targets if t in modules), None)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def test_the_engine_package_has_no_import_cycle():
    graph = engine_imports()
    assert f"{PACKAGE}.engine" in graph and graph[f"{PACKAGE}.engine"]  # the walk sees imports at all
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
    graph = engine_imports()
    schedules = [name for name in graph if name.startswith(f"{PACKAGE}.schedules")]
    assert len(schedules) >= 4
    assert [name for name in schedules if f"{PACKAGE}.engine" in graph[name]] == []
    assert all(f"{PACKAGE}.engine" not in graph[name] for name in (f"{PACKAGE}.update", f"{PACKAGE}.state"))
