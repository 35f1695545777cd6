"""No import cycle inside the collectives package.

A cycle works only while every module in it happens to be imported in one order, and a
lazy (function-level) import merely postpones the cycle to the first call, so both count;
imports under `if TYPE_CHECKING:` never run and do not.
The graph is read from the source with ast: every .py file under collectives/ (algorithms/
included) and every import statement anywhere in it. A submodule's import of its parent
package is implicit in Python and not an edge; an explicit `from . import name` of a name
the package's __init__.py defines is (it needs that __init__.py to have run)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "collectives"


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, packages under their own name."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module `name` (at `path`) imports, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            # `import a.b` runs a's and a.b's __init__; a parent package is already running
            found.update(alias.name for alias in node.names
                         if not name.startswith(alias.name + "."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules and (not name.startswith(base + ".")
                                          or alias.name in _bound_names(modules[base])):
                    found.add(base)  # a name the package's __init__.py defines
    found.intersection_update(modules)
    found.discard(name)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of tree except those inside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _bound_names(path: Path) -> set[str]:
    """Names a module binds at its top level (imports, assignments, defs, classes)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(_cycle_through(sorted(component), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from component[0] back to itself inside the component (BFS)."""
    start, members = component[0], set(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def test_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "collectives.kernels" in graph and "collectives.algorithms.ring" in graph
    assert "collectives.cuda_kernels" in graph["collectives.kernels"]  # a function-level import
    assert "collectives.kernels" in graph["collectives.algorithms.ring"]  # from .. import


def test_graph_sees_names_of_a_package_init(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\nVALUE = 1\n")
    (pkg / "a.py").write_text("from . import _C\n\ndef f():\n    from . import VALUE\n")
    (pkg / "b.py").write_text("import pkg.a\nfrom . import _C\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg"}, "pkg.b": {"pkg.a"}}
    assert find_cycles(graph) == [["pkg", "pkg.a", "pkg"]]


def test_find_cycles_reports_one_path_per_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
