"""Each layer owns its state: no module writes another layer's per-communicator state.

A communicator's state is its Topology (runtime/topology.py), which owns the runtime's
fields, and the state objects the upper layers hang on it (`topo.state(Kind)`), each owned
by the layer whose package defines Kind. Read from the source with ast, over every module
of collectives/ and optim/:
- a Topology field is written (assigned, deleted, augmented, item-assigned, or mutated by
  a method such as clear/update/pop/append) only in runtime/topology.py: any such write
  through an attribute chain that passes a Topology field (topo.fast[k] = v,
  topo.limit.timeout_s = 1, topo.nodes.append(...)) elsewhere is reported, unless the
  chain starts at `self` with that field (a class writing its own attribute);
- `.state(Kind)` is asked for only inside Kind's layer: another layer calls a function of
  the owner;
- a field of a state class is written only inside its owner's layer;
- no module keeps a communicator's state in a module-level dict keyed by the communicator
  (its handle, or a `comm` / `topo` argument): such state belongs on its owner (a state
  object, or an attribute of the MPI communicator itself);
- the engine's state (`ENGINE.native`, C++) is written only in runtime/: other layers call
  its methods (a joined rank's count is set by `contribute`, not assigned from join())."""

from __future__ import annotations

import ast
from pathlib import Path

from test_imports import TREES, _modules, layer_of

TOPOLOGY = "collectives.runtime.topology"
#: Methods that change the object they are called on.
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
            "setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def _self_fields(cls: ast.ClassDef) -> set[str]:
    """The attributes a class assigns on self (its fields), and its __slots__."""
    out = set()
    for node in ast.walk(cls):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and _is_self(target.value):
                out.add(target.attr)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                for t in node.targets):
            out |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)
                    and isinstance(e.value, str)}
    return out


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _targets(node: ast.AST) -> list[ast.AST]:
    """What node writes: assignment and deletion targets (tuples unpacked), and the object
    a mutating method is called on."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS:
        found = [node.func.value]
    else:
        return []
    out = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            out.append(t)
    return out


def _chain(target: ast.AST) -> list[ast.Attribute]:
    """The attribute nodes a written target reaches its object through, outermost first
    (subscripts and calls on the way are passed over: topo.fast[k] -> [.fast])."""
    out = []
    node = target
    while True:
        if isinstance(node, ast.Attribute):
            out.append(node)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr != "state":
            node = node.func.value
        else:
            return out


def _state_kinds(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Every `.state(Kind)` call in tree, with Kind's name (its last dotted part)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "state" and len(node.args) == 1:
            arg = node.args[0]
            name = arg.attr if isinstance(arg, ast.Attribute) else getattr(arg, "id", None)
            if name is not None:
                out.append((node, name))
    return out


def violations(trees: dict[Path, str] = TREES) -> list[str]:
    """Every write of another layer's state in the modules under trees."""
    modules = _modules(trees)
    parsed = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    topology = next(n for n in parsed[TOPOLOGY].body
                    if isinstance(n, ast.ClassDef) and n.name == "Topology")
    topo_fields = _self_fields(topology)
    classes = {node.name: (name, node) for name, tree in parsed.items()
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    kinds = {kind for tree in parsed.values() for _, kind in _state_kinds(tree)}
    owners: dict[str, int] = {}  # a state class's field -> the owner's layer
    for kind in kinds:
        module, cls = classes[kind]
        for field in _self_fields(cls):
            owners[field] = layer_of(module)
    out = []
    for name, tree in parsed.items():
        layer = layer_of(name)
        path = modules[name]
        here = path.relative_to(path.parents[1])
        for call, kind in _state_kinds(tree):
            if layer_of(classes[kind][0]) != layer:
                out.append(f"{here}:{call.lineno}: asks for {kind}, another layer's state")
        for node in ast.walk(tree):
            for target in _targets(node):
                chain = _chain(target)
                if not chain:
                    continue
                outer, inner = chain[0], chain[-1]
                own = _is_self(inner.value)
                passed = [a.attr for a in chain if not (a is inner and own)]
                if name != TOPOLOGY and any(a in topo_fields for a in passed):
                    out.append(f"{here}:{node.lineno}: writes Topology.{'.'.join(reversed(passed))}")
                elif not own and outer.attr in owners and owners[outer.attr] != layer:
                    out.append(f"{here}:{node.lineno}: writes .{outer.attr}, another layer's state")
    return out


def engine_writes(trees: dict[Path, str] = TREES) -> list[str]:
    """Every write of an attribute of `ENGINE.native` (directly, or through a name bound to
    it) outside runtime/."""
    out = []
    for name, path in _modules(trees).items():
        if name.startswith("collectives.runtime"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and _is_engine(node.value) for t in node.targets if isinstance(t, ast.Name)}
        here = path.relative_to(path.parents[1])
        for node in ast.walk(tree):
            for target in _targets(node):
                chain = _chain(target)
                if chain and (any(_is_engine(a) for a in chain) or (
                        isinstance(chain[-1].value, ast.Name) and chain[-1].value.id in aliases)):
                    out.append(f"{here}:{node.lineno}: writes the engine's "
                               f"{'.'.join(a.attr for a in reversed(chain))}")
    return out


def _is_engine(node: ast.AST) -> bool:
    """Whether node is `ENGINE.native`."""
    return isinstance(node, ast.Attribute) and node.attr == "native" \
        and isinstance(node.value, ast.Name) and node.value.id == "ENGINE"


#: Names that hold a communicator (or its Topology) where they are used as a key.
COMMUNICATOR_NAMES = {"comm", "topo", "communicator"}


def _module_dicts(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a dict ({...}, dict(...), or annotated
    dict[...])."""
    out = set()
    for node in tree.body:
        value, targets = None, []
        if isinstance(node, ast.Assign):
            value, targets = node.value, node.targets
        elif isinstance(node, ast.AnnAssign):
            value, targets = node.value, [node.target]
            if "dict" in ast.unparse(node.annotation).lower():
                out |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(value, ast.Dict) or (isinstance(value, ast.Call)
                                           and getattr(value.func, "id", None) == "dict"):
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _communicator_key(key: ast.AST, handles: set[str]) -> bool:
    """Whether a key expression is a communicator: it reads a .handle, or is (or holds) a
    name that does."""
    return any((isinstance(n, ast.Attribute) and n.attr == "handle")
               or (isinstance(n, ast.Name) and (n.id in handles or n.id in COMMUNICATOR_NAMES))
               for n in ast.walk(key))


def keyed_by_communicator(trees: dict[Path, str] = TREES) -> list[str]:
    """Every use of a module-level dict with a communicator as its key."""
    out = []
    for path in _modules(trees).values():
        tree = ast.parse(path.read_text(), str(path))
        dicts = _module_dicts(tree)
        if not dicts:
            continue
        handles = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and any(isinstance(n, ast.Attribute) and n.attr == "handle"
                           for n in ast.walk(node.value))
                   for t in node.targets if isinstance(t, ast.Name)}
        here = path.relative_to(path.parents[1])
        for node in ast.walk(tree):
            key, used = None, None
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                key, used = node.slice, node.value.id
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.args:
                key, used = node.args[0], node.func.value.id
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                    and isinstance(node.comparators[0], ast.Name):
                key, used = node.left, node.comparators[0].id
            if used in dicts and _communicator_key(key, handles):
                out.append(f"{here}:{node.lineno}: module-level {used} keyed by a communicator")
    return out


def _package(tmp_path: Path, files: dict[str, str]) -> dict[Path, str]:
    """A copy of collectives/ and optim/ under tmp_path with files (relative paths) set."""
    trees = {}
    for folder, dotted in TREES.items():
        copy = tmp_path / folder.name
        for path in folder.rglob("*.py"):
            target = copy / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
        trees[copy] = dotted
    for rel, text in files.items():
        path = tmp_path / rel
        path.write_text(path.read_text() + text)
    return trees


def test_no_module_writes_another_layers_state():
    assert violations() == []


def test_a_write_of_a_topology_field_elsewhere_is_reported(tmp_path):
    trees = _package(tmp_path, {"collectives/auto/online.py": (
        "\n\ndef _bad(topo):\n    topo.limit.timeout_s = 1.0\n    topo.nodes.append([0])\n")})
    found = violations(trees)
    assert len(found) == 2, found
    assert all("auto/online.py" in f and "writes Topology." in f for f in found), found


def test_a_write_of_another_layers_state_is_reported(tmp_path):
    trees = _package(tmp_path, {
        "collectives/auto/online.py": (
            "\n\ndef _bad(topo):\n    from collectives.api import calls\n"
            "    calls.of(topo).fast.clear()\n"),
        "collectives/horovod/common.py": (
            "\n\ndef _bad(topo):\n    from collectives.auto.state import AutoState\n"
            "    topo.state(AutoState).settled[0] = 'ring'\n")})
    found = violations(trees)
    assert any("auto/online.py" in f and ".fast" in f for f in found), found
    assert any("horovod/common.py" in f and "asks for AutoState" in f for f in found), found
    assert any("horovod/common.py" in f and ".settled" in f for f in found), found


def test_only_the_runtime_writes_the_engines_state():
    assert engine_writes() == []


def test_a_write_of_the_engines_state_elsewhere_is_reported(tmp_path):
    """As join() set the engine's joined count, and the timeline its recording flag."""
    trees = _package(tmp_path, {
        "collectives/api/join.py": (
            "\n\ndef _bad(n):\n    native = ENGINE.native\n    native.joined = n\n"),
        "collectives/api/timeline.py": "\n\ndef _bad():\n    ENGINE.native.tracing = True\n"})
    found = engine_writes(trees)
    assert len(found) == 2, found
    assert any("api/join.py" in f and "joined" in f for f in found), found
    assert any("api/timeline.py" in f and "tracing" in f for f in found), found


def test_no_module_keeps_a_communicators_state_in_a_module_dict():
    assert keyed_by_communicator() == []


def test_a_module_dict_keyed_by_a_communicator_is_reported(tmp_path):
    """As shm's windows were kept (a dict by communicator handle), and by a Topology."""
    trees = _package(tmp_path, {"collectives/algorithms/shm.py": (
        "\n\n_by_handle: dict[int, object] = {}\n_by_topo = {}\n\n\n"
        "def _bad(comm, topo):\n    key = comm.handle\n    _by_handle[key] = 1\n"
        "    return _by_topo.get(topo)\n")})
    found = keyed_by_communicator(trees)
    assert len(found) == 2 and all("algorithms/shm.py" in f for f in found), found
