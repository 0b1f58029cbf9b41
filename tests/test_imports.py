"""The package's import structure, read from the source with ``ast`` (nothing is imported).

Rules checked here:

* **No import cycle** among the modules of ``prophet_tf`` (its benchmarks included). Every import
  counts, wherever it is written: at module level, inside a function, or under
  ``TYPE_CHECKING``. A cycle that only works because one of its imports is deferred into a
  function is still a cycle: the modules cannot be understood, tested or moved one at a time.
* **No private name across modules**: ``from prophet_tf.x import _y`` (or ``x._y`` on an imported
  module ``x``) in another module of the package. Private *modules* of the package
  (``from prophet_tf import _gradients``) are fine: they are private to the package, not to a
  module. A name another module needs is public in its module. Tests are white-box and may
  reach into the module they test, so this rule covers the package only.
* **No import from a ``__main__`` module**, in the package or in the tests: ``__main__`` files
  parse the command line and call; what others share lives in a module of its own.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "prophet_tf"
# Each test reads the whole package: parse every file once.
_parse = functools.lru_cache(maxsize=None)(ast.parse)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the package: dotted name -> file."""
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _is_package(name: str, modules: dict[str, pathlib.Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


class Import:
    """One imported name: ``module`` is the package module it resolves to; ``name`` the name
    taken from it (None for ``import x`` or a submodule); ``line`` where it is written."""

    def __init__(self, module: str, name: Optional[str], line: int) -> None:
        self.module, self.name, self.line = module, name, line


def _imports(source: str, importer: str, modules: dict[str, pathlib.Path],
             importer_is_package: bool) -> Iterator[Import]:
    """The imports of package modules in ``source`` (all of them: module level, in functions,
    under TYPE_CHECKING), resolved to the package module each one loads."""
    tree = _parse(source)
    own_package = importer if importer_is_package else importer.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield Import(alias.name, None, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    yield Import(sub, None, node.lineno)
                else:
                    yield Import(target, alias.name, node.lineno)


def _private_attributes(source: str, modules: dict[str, pathlib.Path]) -> Iterator[tuple[str, str, int]]:
    """``alias._name`` where ``alias`` is bound to a package module by an import in ``source``
    (the binding is looked up by name over the whole file: a conservative approximation)."""
    tree = _parse(source)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    bound[alias.asname or alias.name] = sub
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            yield bound[node.value.id], node.attr, node.lineno


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}, over every import of a package module."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for imp in _imports(path.read_text(), name, modules, _is_package(name, modules)):
            if imp.module != name:
                edges.setdefault(imp.module, imp.line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """The circles of the graph: each strongly connected component of more than one module
    (Tarjan) as (its modules, one cycle through it back to its first module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted((c, _cycle_through(graph, set(c), c[0])) for c in components)


def _cycle_through(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return [start]


def describe_cycle(members: list[str], cycle: list[str], graph: dict[str, dict[str, int]],
                   modules: dict[str, pathlib.Path]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        where = modules[a].relative_to(ROOT)
        steps.append(f"  {a} -> {b} ({where}:{graph[a][b]})")
    return (f"{len(members)} modules import each other: {', '.join(members)}; for example:\n"
            + "\n".join(steps))


def private_name_imports(modules: dict[str, pathlib.Path]) -> list[str]:
    """``from <package module> import _name`` and ``<module alias>._name`` across modules."""
    found = []
    for name, path in modules.items():
        source = path.read_text()
        where = path.relative_to(ROOT)
        for imp in _imports(source, name, modules, _is_package(name, modules)):
            if imp.module != name and imp.name and imp.name.startswith("_"):
                found.append(f"{where}:{imp.line}: imports {imp.name} from {imp.module}")
        for module, attr, line in _private_attributes(source, modules):
            if module != name:
                found.append(f"{where}:{line}: uses {module}.{attr}")
    return sorted(set(found))


def main_module_imports(files: list[pathlib.Path], modules: dict[str, pathlib.Path]) -> list[str]:
    found = []
    for path in files:
        name = _module_name(path) if path.is_relative_to(ROOT / PACKAGE) else path.stem
        for imp in _imports(path.read_text(), name, modules,
                            path.name == "__init__.py"):
            if imp.module.rsplit(".", 1)[-1] == "__main__":
                found.append(f"{path.relative_to(ROOT)}:{imp.line}: imports {imp.module}")
    return sorted(set(found))


# ---- the checker itself ---------------------------------------------------------------------

def test_finds_a_cycle_through_a_deferred_import():
    modules = {"p": pathlib.Path("p/__init__.py"), "p.a": pathlib.Path("p/a.py"),
               "p.b": pathlib.Path("p/b.py"), "p.c": pathlib.Path("p/c.py")}
    sources = {
        "p.a": "from p import b\n",
        "p.b": "def f():\n    from p.c import g\n",
        "p.c": "import p.a\n",
    }
    graph = {name: {imp.module: imp.line
                    for imp in _imports(src, name, modules, False)}
             for name, src in sources.items()}
    assert find_cycles(graph) == [(["p.a", "p.b", "p.c"], ["p.a", "p.b", "p.c", "p.a"])]
    del graph["p.c"]["p.a"]
    assert find_cycles(graph) == []


def test_reads_private_names_and_relative_imports():
    modules = {"p": pathlib.Path("p/__init__.py"), "p.a": pathlib.Path("p/a.py"),
               "p.sub": pathlib.Path("p/sub/__init__.py"), "p.sub.b": pathlib.Path("p/sub/b.py")}
    source = ("from p.a import _hidden, shown\nfrom . import b\nfrom p import a\n"
              "from p import _private_module_is_not_a_module_here\nx = a._secret\n")
    imports = [(i.module, i.name) for i in _imports(source, "p.sub.c", modules, False)]
    assert imports == [("p.a", "_hidden"), ("p.a", "shown"), ("p.sub.b", None), ("p.a", None),
                       ("p", "_private_module_is_not_a_module_here")]
    assert list(_private_attributes(source, modules)) == [("p.a", "_secret", 5)]


# ---- the package ------------------------------------------------------------------------------

def test_package_has_no_import_cycle():
    modules = package_modules()
    graph = import_graph(modules)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in prophet_tf (every import counts, deferred ones too):\n" + \
        "\n".join(describe_cycle(members, cycle, graph, modules) for members, cycle in cycles)


def test_no_private_name_crosses_modules():
    found = private_name_imports(package_modules())
    assert not found, ("private names used outside their module (make the name public in its "
                       "module, or move it to where it is used):\n" + "\n".join(found))


@pytest.mark.parametrize("where", ["prophet_tf", "tests"])
def test_nothing_imports_a_main_module(where):
    modules = package_modules()
    files = sorted((ROOT / where).rglob("*.py"))
    found = main_module_imports(files, modules)
    assert not found, ("imports from __main__ modules (move what is shared into a module of its "
                       "own; __main__ only parses the command line and calls):\n" + "\n".join(found))


@pytest.mark.parametrize("lower, upper", [
    ("prophet_tf._keras", "prophet_tf.strategy"),    # the strategy imports the Keras glue
    ("prophet_tf.runtime", "prophet_tf._keras"),     # the glue and the strategy use the runtime
    ("prophet_tf.runtime", "prophet_tf.strategy"),
])
def test_layers_import_downwards(lower, upper):
    modules = package_modules()
    graph = import_graph(modules)
    below = [m for m in graph if m == lower or m.startswith(lower + ".")]
    found = [f"{modules[m].relative_to(ROOT)}:{line}: imports {target}"
             for m in below for target, line in graph[m].items()
             if target == upper or target.startswith(upper + ".")]
    assert not found, f"{lower} is below {upper} and must not import it:\n" + "\n".join(found)
