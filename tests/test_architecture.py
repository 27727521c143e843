"""The package's shape: no import cycles, and dependencies that point one way.

Imports are read from the source (``ast``), including those inside functions and under
``TYPE_CHECKING``: a cycle hidden in a function body is still a cycle for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "kvroute"

# Who may import whom, by top-level room. Every room may import the foundation (the
# settings, the error types, the native index) and itself; the settings validate policy
# names, so they may import routing.
FOUNDATION = {"kvroute", "kvroute._native", "kvroute.config", "kvroute.errors"}
ALLOWED = {
    "foundation": {"routing"},
    "__main__": {"cli"},
    "service": {"fleet", "routing", "events"},
    "fleet": {"routing"},
    "routing": set(),
    "events": set(),
    "sim": {"routing", "fleet", "events"},
    "eval": {"sim"},
    "commands": {"service", "fleet", "routing", "events", "sim", "eval"},
    "cli": {"commands"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvroute"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("kvroute"):
                found.add(node.module)
                # ``from kvroute.x import y`` may name a submodule ``y``.
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvroute"


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = _graph()
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_dependencies_point_one_way() -> None:
    wrong = []
    for module, deps in _graph().items():
        room = _room(module)
        if module in FOUNDATION:
            room = "foundation"
        allowed = ALLOWED.get(room, set()) | {room}
        for dep in deps:
            if dep in FOUNDATION or dep.startswith("kvroute._native"):
                continue
            if _room(dep) not in allowed:
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


@pytest.mark.parametrize("room", ["service", "fleet", "routing", "events", "sim", "eval"])
def test_every_room_says_what_it_is_for(room: str) -> None:
    init = PACKAGE / room / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{room}/__init__.py has no docstring"
