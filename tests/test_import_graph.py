"""No module of `app/` or of the client package imports itself in a circle. The graph is read
from the source (`ast`), not by importing: an edge is a module-level import, those under
`if TYPE_CHECKING:` included (a cycle of types is a cycle of design); an import inside a
function or class body is not one. Importing a module runs its parent packages' `__init__`,
so those count as edges too, except the importer's own packages (already running): importing
a name from one of those is an edge."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "app", ROOT / "clients" / "python" / "rlserve_client"]


def modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run when the module is: at its top level, or in its top-level blocks (`if`,
    `try`, `with`), never in a function's or class's body."""
    pending: deque[ast.AST] = deque(tree.body)
    while pending:
        node = pending.popleft()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            pending.extend(ast.iter_child_nodes(node))


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module's edges to the modules of its package that its import statements run."""
    known = modules(package)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    for alias in node.names
                ]
            for target in targets:
                parts = target.split(".")
                for depth in range(1, len(parts) + 1):  # the packages on the way run too
                    step = ".".join(parts[:depth])
                    on_the_way = depth < len(parts) and name.startswith(f"{step}.")
                    if step in known and step != name and not on_the_way:
                        graph[name].add(step)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def loop_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """One import loop inside `group`, from its first module back to it."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return group


def test_the_cycle_finder_finds_a_type_checking_cycle_and_ignores_function_imports() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.b\n"
    imports = list(module_level_imports(ast.parse(source)))
    assert [n.names[0].name for n in imports[1:]] == ["app.b"]
    lazy = "def f():\n    import app.b\nclass C:\n    import app.c\n"
    assert list(module_level_imports(ast.parse(lazy))) == []
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert loop_through(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_module_imports_itself_in_a_circle(package: Path) -> None:
    graph = import_graph(package)
    assert f"{package.name}.tensor_wire" in graph or "app.updates.service" in graph
    found = cycles(graph)
    report = "\n".join(" -> ".join(loop_through(graph, group)) for group in found)
    assert not found, f"import cycles among {package.name} modules:\n{report}"


# The layers of the weight code, lowest first: the weights core (checkpoint layouts, adapters,
# staging, the transfer engine and its transports) imports no engine; the engines import no
# update control and know no caller (who owns an adapter, who may change it, and the words a
# route names a field with are `app.updates.adapters`' and the routes'); the update control
# (`app.updates`) drives both.
CALLERS = ("app.common.caller", "app.adapters", "app.ops")
LAYERS = [
    ("app.weights", ("app.engine", "app.updates", "app.deploy", "app.dialects", *CALLERS)),
    ("app.engine", ("app.updates", "app.deploy", "app.dialects", *CALLERS)),
]


@pytest.mark.parametrize(("lower", "upper"), LAYERS, ids=[lower for lower, _ in LAYERS])
def test_the_weights_core_and_the_engines_import_nothing_above_them(
    lower: str, upper: tuple[str, ...]
) -> None:
    graph = import_graph(ROOT / "app")
    assert f"{lower}.staging" in graph or f"{lower}.registry" in graph
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name == lower or name.startswith(f"{lower}.")
        for target in targets
        if target.startswith(upper)
    )
    assert not upward, f"{lower} imports modules above it:\n" + "\n".join(upward)
