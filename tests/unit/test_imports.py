"""The layers: every import between collectives' subpackages points down, and no import
cycle anywhere in collectives/ or optim/ (installed as collectives.optim).

The graph is read from the source with ast: every .py file under collectives/ and optim/ and
every import statement anywhere in it, function-level and `if TYPE_CHECKING:` ones included
(a lazy import only postpones a cycle to the first call; a type-only import still ties the
modules' designs together). A submodule's `import` of its own parent package's name is an
edge (it uses the package's names); `from pkg import sub` is an edge to pkg.sub, and
`from pkg import name` to pkg when pkg's __init__.py binds name. And what the facade imports:
torch only once the job does, the backend registered either way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: folder -> the dotted name it is installed as
TREES = {ROOT / "collectives": "collectives", ROOT / "optim": "collectives.optim"}
#: The layers, lowest first: a module may import its own layer's modules and lower layers'.
#: The package's own __init__.py (the facade users import) stands above everything.
LAYERS = (
    ("leaves", ("collectives.config", "collectives.dtypes", "collectives.ops",
                "collectives.mpi_defaults", "collectives._C")),
    ("kernels", ("collectives.kernels",)),
    ("runtime", ("collectives.runtime",)),
    ("algorithms", ("collectives.algorithms",)),
    ("auto", ("collectives.auto",)),
    ("compression", ("collectives.compression",)),
    ("api", ("collectives.api",)),
    ("optim", ("collectives.optim",)),
    ("elastic", ("collectives.elastic",)),
    ("integrations", ("collectives.integrations",)),
    ("horovod", ("collectives.horovod",)),
    ("facade", ("collectives",)),
)


def _modules(trees: dict[Path, str]) -> dict[str, Path]:
    """Dotted module name -> source file, packages under their own name."""
    out = {}
    for folder, dotted in trees.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([dotted, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module `name` (at `path`) imports, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
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


def import_graph(trees: dict[Path, str] = TREES) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports."""
    modules = _modules(trees)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer module belongs to (its longest matching prefix)."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    if index is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return index


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b (layer x above layer y)' for every import of a higher layer's module."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if layer_of(b) > layer_of(a):
                out.append(f"{a} -> {b} ({LAYERS[layer_of(b)][0]} is above "
                           f"{LAYERS[layer_of(a)][0]})")
    return out


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


def _package(tmp_path: Path, files: dict[str, str]) -> dict[Path, str]:
    for rel, text in files.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    return {tmp_path / "pkg": "pkg"}


def test_graph_sees_lazy_relative_and_type_checking_imports():
    graph = import_graph()
    assert "collectives.kernels.cuda" in graph["collectives.kernels"]  # a function-level import
    assert "collectives.kernels" in graph["collectives.algorithms.ring"]
    assert "collectives.runtime.engine" in graph["collectives.runtime.p2p"]
    assert "collectives.api" in graph["collectives.optim.distributed"]  # optim/ mapped


def test_graph_sees_names_of_a_package_init(tmp_path):
    trees = _package(tmp_path, {
        "__init__.py": "from .a import f\nVALUE = 1\n",
        "a.py": "from . import _C\n\ndef f():\n    from . import VALUE\n",
        "b.py": "import pkg.a\nfrom . import _C\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n",
        "d.py": "import pkg\n",
    })
    graph = import_graph(trees)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg"}, "pkg.b": {"pkg.a"},
                     "pkg.c": {"pkg.b"}, "pkg.d": {"pkg"}}
    assert find_cycles(graph) == [["pkg", "pkg.a", "pkg"]]


def test_find_cycles_reports_one_path_per_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]


def test_an_upward_import_is_reported():
    graph = import_graph()
    graph["collectives.runtime.engine"] = graph["collectives.runtime.engine"] | {
        "collectives.api.calls"}
    assert upward_imports(graph) == [
        "collectives.runtime.engine -> collectives.api.calls (api is above runtime)"]


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_import_cycle_in_collectives_or_optim():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_import_points_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_every_layer_says_what_it_owns_and_may_import():
    for _, prefixes in LAYERS[1:-1]:
        for prefix in prefixes:
            init = ROOT / Path(*prefix.split(".")) / "__init__.py"
            if prefix == "collectives.optim":
                init = ROOT / "optim" / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "May import" in doc, f"{init}: its docstring says nothing of what it may import"


def test_optim_has_one_name():
    """optim/ is collectives.optim; top-level `optim`, from the checkout's root, is refused
    with the name to use, rather than loading every module a second time."""
    proc = subprocess.run([sys.executable, "-c", "import importlib; importlib.import_module('optim')"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ImportError: optim installs as collectives.optim" in \
        proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import collectives.optim, sys; "
                           "print(sorted(m for m in sys.modules if m.startswith('optim')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


def test_numpy_calls_leave_torch_unimported():
    """A NumPy-only job never imports torch (about 1.6 s of CPU in every rank)."""
    assert _run("import sys, numpy as np, collectives as C, collectives.elastic; C.init(); "
                "C.allreduce(np.ones(3)); C.allgather(np.ones(2)); C.broadcast(np.ones(1)); "
                "C.grouped_allreduce([np.ones(2), np.ones(3)]); "
                "C.allreduce(np.ones(3, np.float32), compression=C.Compression.fp16); "
                "print('torch' in sys.modules)") == "False"


@pytest.mark.parametrize("first", ["torch", "collectives", "collectives.ddp_hooks", "probe"])
def test_the_backend_is_registered_whichever_is_imported_first(first):
    """torch before collectives, after it, or imported by the DDP hooks' documented name; and
    after a library asked whether torch is installed (a spec found, not executed)."""
    code = {"torch": "import torch, collectives",
            "collectives": "import collectives, torch",
            "collectives.ddp_hooks": "from collectives.ddp_hooks import int8_hook",
            "probe": "import collectives, importlib.util; importlib.util.find_spec('torch'); "
                     "import torch"}[first]
    assert _run(f"{code}; import torch.distributed as dist; "
                "print('collectives' in dist.Backend.backend_list)") == "True"
