"""course_lib's import graph: no cycle (lazy imports included), layers import only downwards.

The graph is read from the source with ``ast`` (nothing is imported): an edge for every ``import``
and ``from … import …`` at any depth (a function's lazy import ties two modules all the same),
``from x import y`` going to ``x.y`` when that is a module, and ``importlib.import_module`` with a
module's name. ARCHITECTURE.md draws the layers; :data:`LAYERS` is the rule this test holds them to.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "course_lib"

# Lowest first. A module may import its own layer and the layers before it, never a later one.
LAYERS = (
    ("constants", ("course_lib.constants",)),
    ("platform", ("course_lib.platform",)),
    ("attention", ("course_lib.attention",)),
    ("kernels", ("course_lib.kernels",)),
    ("integrations", ("course_lib.integrations",)),
    ("measure", ("course_lib.measure",)),
    ("teaching", ("course_lib.teaching",)),
    # the package itself: the public names (loaded lazily) and the old module paths (_moved)
    ("package", ("course_lib", "course_lib._moved")),
)
# The kernels' dispatch: the public entry points (api) and their launch plans (plan). The kernels
# below them never import them (flash-attn's interface over its kernels has the same shape).
DISPATCH = ("course_lib.kernels.api", "course_lib.kernels.plan")
MAX_TOP_LEVEL_MODULES = 10  # issue 38: at most 10 modules left at the top of course_lib


def modules(package_dir: Path, package: str) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _nearest(name: str, known) -> str | None:
    """``name`` or the closest enclosing module that exists (``a.b.f`` -> ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, known, package: str) -> set[str]:
    """The modules of ``package`` that module ``name`` (at ``path``) imports, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    targets, strings, dynamic = set(), set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in known else module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                    getattr(node.func, "id", None)) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                targets.add(arg.value)
            else:
                dynamic = True  # import_module(table[name]): every module name the file spells counts
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    if dynamic:
        targets |= {s for s in strings if s in known}
    out = {_nearest(t, known) for t in targets if t == package or t.startswith(package + ".")}
    return {t for t in out if t is not None and t != name}


def graph(package_dir: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules it imports}`` inside the package."""
    known = modules(package_dir, package)
    return {name: imports(name, path, known, package) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another (Tarjan's strongly connected components),
    as one cycle through the group: ``[a, b, c, a]``."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_through(sorted(g), edges) for g in groups]


def _cycle_through(group: list[str], edges) -> list[str]:
    """A shortest cycle from the group's first module back to it, inside the group."""
    start, inside = group[0], set(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & inside):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return group + [start]


def layer_of(name: str, layers=LAYERS) -> int | None:
    """Index in ``layers`` of the layer ``name`` belongs to (the longest matching prefix)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (name == prefix or (name.startswith(prefix + ".") and prefix != PACKAGE)) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward_imports(edges, layers=LAYERS) -> list[str]:
    """``"a (layer) imports b (higher layer)"`` for every import against the layer order."""
    bad = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb > la:
                bad.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return bad


def dispatch_imports(edges) -> list[str]:
    """A kernel module (not the dispatch) importing the dispatch."""
    return [f"{a} imports {b}" for a in sorted(edges) if a.startswith("course_lib.kernels.") and a not in DISPATCH
            for b in sorted(edges[a]) if b in DISPATCH]


def moved_names() -> dict[str, str]:
    """``course_lib._moved.MOVED``, read as a literal."""
    tree = ast.parse((ROOT / PACKAGE / "_moved.py").read_text(encoding="utf-8"))
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "MOVED" for t in n.targets))


# ---- the library -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edges():
    return graph(ROOT / PACKAGE)


def test_no_import_cycle(edges):
    found = cycles(edges)
    assert not found, "import cycles inside course_lib (lazy imports count):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_every_module_has_a_layer(edges):
    assert [m for m in edges if layer_of(m) is None] == [], "add the module to a layer (LAYERS, ARCHITECTURE.md)"


def test_layers_import_only_downwards(edges):
    assert upward_imports(edges) == []


def test_kernels_never_import_the_dispatch(edges):
    assert dispatch_imports(edges) == []


def test_at_most_ten_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / PACKAGE).glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_architecture_draws_every_layer():
    """ARCHITECTURE.md's picture names each layer's folder (or module) as the test knows it."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for name, prefixes in LAYERS[:-1]:
        spelled = prefixes[0].split(".")[-1]
        assert f"{spelled}/" in text or f"{spelled}.py" in text, name


def test_the_library_uses_no_old_module_path():
    """The old paths are for notebooks saved before the layout; inside course_lib only the new ones."""
    old = {o for o in moved_names()}
    known = modules(ROOT / PACKAGE, PACKAGE)
    found = []
    for name, path in known.items():
        if name == "course_lib._moved":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            spelled = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                       if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name}: {s}" for s in spelled if s in old and s not in known]
    assert found == []


# ---- the graph reader itself, on small packages --------------------------------------------------

def _package(tmp_path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_lazy_import_closes_a_cycle(tmp_path):
    root = _package(tmp_path, {"a.py": "from pkg import b\n",
                               "b.py": "def f():\n    from pkg.c import g\n",
                               "c.py": "def g():\n    import pkg.a\n"})
    assert cycles(graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_from_import_of_a_name_is_an_edge_to_its_module_and_relative_imports_resolve(tmp_path):
    root = _package(tmp_path, {"sub/__init__.py": "", "sub/x.py": "from ..y import helper\nfrom . import z\n",
                               "sub/z.py": "", "y.py": "import importlib\nT = {'k': 'pkg.sub.z'}\n"
                                                      "def f(k):\n    return importlib.import_module(T[k])\n"})
    edges = graph(root, "pkg")
    assert edges["pkg.sub.x"] == {"pkg.y", "pkg.sub.z"}
    assert edges["pkg.y"] == {"pkg.sub.z"}  # import_module of a table: the names it spells
    assert cycles(edges) == []


def test_an_upward_import_and_a_kernel_importing_the_dispatch_are_named():
    layers = (("low", ("course_lib.platform",)), ("high", ("course_lib.teaching",)))
    assert upward_imports({"course_lib.platform.runtime": {"course_lib.teaching.checks"}}, layers) == [
        "course_lib.platform.runtime (low) imports course_lib.teaching.checks (high)"]
    assert dispatch_imports({"course_lib.kernels.decoding": {"course_lib.kernels.api"},
                             "course_lib.kernels.api": {"course_lib.kernels.plan"}}) == [
        "course_lib.kernels.decoding imports course_lib.kernels.api"]
