"""The package's layering reads one way: no module of tinyloop (tinyloop/ and the fallback/ it
installs as tinyloop.fallback) imports, directly or through others, a module that imports it.

Imports are read from the source (ast), at every level: a function-level import closes a circle
as much as a top-level one does, it only postpones it. `from . import x` depends on the
submodule x; `from .m import name` on m. A package's __init__ counts as a module of its own.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tinyloop": ROOT / "tinyloop", "tinyloop.fallback": ROOT / "fallback"}


def modules():
    """{dotted name: source path} of every module of the installed package."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imported(name, path, known):
    """The modules of `known` that module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            targets.update(s for s in submodules if s in known)
            if not all(s in known for s in submodules):
                targets.add(base)
    return {t for t in targets if t in known and t != name}


def import_graph():
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def circles(graph):
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_reader_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "model.py"
    source.write_text("from . import params as P\nfrom .engine import Engine\n"
                      "def f():\n    from .demo import run\n    import tinyloop.cli\n")
    known = {"tinyloop", "tinyloop.params", "tinyloop.engine", "tinyloop.demo",
             "tinyloop.cli", "tinyloop.model"}
    assert imported("tinyloop.model", source, known) == {
        "tinyloop.params", "tinyloop.engine", "tinyloop.demo", "tinyloop.cli"}


def test_tinyloop_has_no_import_circle():
    graph = import_graph()
    assert {"tinyloop.model", "tinyloop.demo", "tinyloop.fallback.engine"} <= set(graph)
    assert "tinyloop.bundled" in graph["tinyloop.model"]      # the graph sees real imports
    assert circles(graph) == []
