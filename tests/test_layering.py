"""The package's layering reads one way: no module of tinyloop (tinyloop/ and the fallback/ it
installs as tinyloop.fallback) imports, directly or through others, a module that imports it.

Imports are read from the source (ast), at every level: a function-level import closes a circle
as much as a top-level one does, it only postpones it. `from . import x` depends on the
submodule x; `from .m import name` on m. A package's __init__ counts as a module of its own.

libtinyloop's C sources (libtinyloop/src) keep one rule of the same kind: the dispatchers call
the ISA kernels, a kernel never reaches back up, so no circle of C modules holds an ISA kernel
(a file stem ending in _scalar, _avx2, _avx512 or _amx); the kernels include their family's
contract header instead of the dispatcher's. A C module is a folder's file stem (cpu/matmul:
matmul.c and matmul.h; .cu and .cuh alike). Module A depends on module B when A #includes one of
B's files, or when A's code names a function or a table whose body is B's: a top-level
definition (it starts at column 0) that is not static, or a static inline function in a header;
a table is a top-level `name = {…}` (a kernel table's initializer). Calling a function, taking
its address (a kernel table, a function pointer) and naming a table all count; a prototype or
an extern declaration does not.
The rule is about kernel modules only; other circles of libtinyloop are not this test's.
"""
import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tinyloop": ROOT / "tinyloop", "tinyloop.fallback": ROOT / "fallback"}
C_ROOT = ROOT / "libtinyloop" / "src"


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


# ---- libtinyloop: the dispatchers call the ISA kernels; a kernel never reaches back up -------

C_SOURCES = (".c", ".h", ".cu", ".cuh")
C_HEADERS = (".h", ".cuh")
ISA_KERNELS = ("_scalar", "_avx2", "_avx512", "_amx")  # the stems of the per-ISA kernel files

_COMMENT_OR_LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
# __attribute__((…)), __launch_bounds__(…), with the blanks after it (a definition keeps column 0)
_ATTRIBUTE = re.compile(r"\b__\w+__\s*\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)[ \t]*")
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\"", re.M)
_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\b(?!\()(.*)$", re.M)  # object-like macros
_DIRECTIVE = re.compile(r"^[ \t]*#.*(?:\\\n.*)*", re.M)
_HEAD = r"^(?=[A-Za-z_])([\w \t*]*?)\b([A-Za-z_]\w*)\s*\([^;{}]*\)\s*"  # starts at column 0
_DEFINITION = re.compile(_HEAD + r"\{", re.M)
_PROTOTYPE = re.compile(_HEAD + r";", re.M)
_EXTERN = re.compile(r"^[ \t]*extern\b[^;{}]*;", re.M)  # a declaration: names nothing
_TABLE = re.compile(r"^(?=[A-Za-z_])([\w \t*]*?)\b([A-Za-z_]\w*)\s*=\s*\{", re.M)  # name = {…} at column 0
_NAME = re.compile(r"(?<![\w.])(?<!->)[A-Za-z_]\w*")  # an identifier that is not a member's


def c_code(text):
    """(the "…" includes of C source `text`, its code: comments out, string and character
    literals emptied, attributes out)."""
    def drop(keep_literals):
        def replace(match):
            found = match.group(0)
            if found[0] in "\"'":
                return found if keep_literals else found[0] * 2
            return " " + "\n" * found.count("\n")  # a comment; lines keep their numbers
        return replace
    includes = _INCLUDE.findall(_COMMENT_OR_LITERAL.sub(drop(True), text))
    return includes, _ATTRIBUTE.sub("", _COMMENT_OR_LITERAL.sub(drop(False), text))


def c_macros(code):
    """{name: words} of the object-like macros `code` defines (INLINE_AVX2 -> static inline)."""
    return {name: body.split() for name, body in _MACRO.findall(code)}


def c_functions(code, macros, header):
    """{name: whether another module can reach it} of the functions `code` defines: the
    top-level definitions, which start at column 0 (an indented `if (f(x)) {` is a statement).
    Reachable: not static, or static inline in a header."""
    found = {}
    for match in _DEFINITION.finditer(code):
        words, seen = [], set()
        pending = match.group(1).split()
        while pending:
            word = pending.pop(0)
            if word in macros and word not in seen:
                seen.add(word)
                pending[:0] = macros[word]
            else:
                words.append(word)
        reachable = "static" not in words or (header and "inline" in words)
        found[match.group(2)] = found.get(match.group(2), False) or reachable
    return found


def c_tables(code):
    """{name: whether another module can reach it} of the tables `code` defines: the top-level
    `name = {…}` definitions; reachable unless static."""
    return {name: "static" not in words.split() for words, name in _TABLE.findall(code)}


def c_names_used(code):
    """The identifiers `code` uses outside its preprocessor lines, prototypes and extern
    declarations."""
    return set(_NAME.findall(_PROTOTYPE.sub(" ", _EXTERN.sub(" ", _DIRECTIVE.sub(" ", code)))))


def c_module_graph(root=C_ROOT):
    """{module: the modules it depends on} for the C sources below `root`; a module is a
    folder's file stem ("cpu/matmul": cpu/matmul.c and cpu/matmul.h)."""
    files = sorted(p for p in root.rglob("*") if p.suffix in C_SOURCES and p.is_file())
    module_of = {p: p.relative_to(root).with_suffix("").as_posix() for p in files}
    parsed = {p: c_code(p.read_text()) for p in files}
    shared_macros = {}
    for p in files:
        if p.suffix in C_HEADERS:
            shared_macros.update(c_macros(parsed[p][1]))
    defined = {m: set() for m in module_of.values()}  # every function a module defines
    owners = {}                                        # name -> modules others reach it in
    for p in files:
        code = parsed[p][1]
        functions = c_functions(code, {**shared_macros, **c_macros(code)}, p.suffix in C_HEADERS)
        functions.update(c_tables(code))
        defined[module_of[p]].update(functions)
        for name, reachable in functions.items():
            if reachable:
                owners.setdefault(name, set()).add(module_of[p])
    graph = {m: set() for m in defined}
    for p in files:
        module = module_of[p]
        includes, code = parsed[p]
        for include in includes:
            for place in (root / include, p.parent / include):
                target = module_of.get(Path(os.path.normpath(place)))
                if target:
                    graph[module].add(target)
                    break
        for name in c_names_used(code) - defined[module]:
            graph[module].update(owners.get(name, ()))
        graph[module].discard(module)
    return graph


def is_isa_kernel(module):
    return module.endswith(ISA_KERNELS)


def kernel_circles(graph):
    """The circles of `graph` that hold an ISA kernel module (the only ones this rule is about)."""
    return [circle for circle in circles(graph) if any(map(is_isa_kernel, circle))]


def test_the_c_reader_tells_definitions_from_calls():
    code = c_code("#define INLINE static inline\n"
                  "/* int commented(void) { */\n"
                  "void tl_run(int n) {\n"
                  "    if (tl_go_avx2(n)) {\n"
                  "        helper(\"tl_quoted(1) {\");\n"
                  "    }\n"
                  "}\n"
                  "static int helper(const char* s) { return s[0]; }\n"
                  "INLINE int twice(int x) { return 2 * x; }\n"
                  "int tl_declared(int x);\n")[1]
    assert c_functions(code, c_macros(code), header=False) == {
        "tl_run": True, "helper": False, "twice": False}
    assert c_functions(code, c_macros(code), header=True)["twice"] is True
    used = c_names_used(code)
    assert {"tl_go_avx2", "helper"} <= used
    assert not {"tl_declared", "tl_quoted", "commented"} & used


def test_the_c_graph_finds_a_kernel_that_reaches_back(tmp_path):
    k = tmp_path / "k"
    k.mkdir()
    (k / "run.h").write_text("static inline int k_twice(int x) { return 2 * x; }\nint k_run(int n);\n")
    (k / "run.c").write_text("#include \"k/run.h\"\nint k_go_avx2(int n);\n"
                             "static int own(int n) { return -n; }\n"
                             "int k_run(int n) {\n    if (k_go_avx2(n)) {\n        return own(1);\n    }\n"
                             "    return 0;\n}\n")
    (k / "go_avx2.c").write_text("#include \"run.h\"\nint k_go_avx2(int n) { return k_twice(n); }\n")
    (k / "table_scalar.c").write_text("static int own(int n) { return n; }\n"  # not run.c's own
                                      "int (*const k_table)(int) = own;\n")
    graph = c_module_graph(tmp_path)
    assert graph == {"k/run": {"k/go_avx2"}, "k/go_avx2": {"k/run"}, "k/table_scalar": set()}
    assert kernel_circles(graph) == [["k/go_avx2", "k/run"]]
    (k / "tables.c").write_text("#include \"k/go.h\"\nconst struct k_kernels k_fast = {k_go_avx2};\n"
                                "static const struct k_kernels k_own = {k_go_avx2};\n")
    (k / "pick.c").write_text("extern const struct k_kernels k_fast;\n"
                              "const struct k_kernels* k_pick(void) { return &k_fast; }\n")
    graph = c_module_graph(tmp_path)
    assert graph["k/pick"] == {"k/tables"} and graph["k/tables"] == {"k/go_avx2"}  # a table counts
    (k / "tables.c").unlink()
    (k / "pick.c").unlink()
    (k / "go.h").write_text("static inline int k_twice(int x) { return 2 * x; }\n")  # a contract
    (k / "run.h").write_text("#include \"k/go.h\"\nint k_run(int n);\n")
    (k / "go_avx2.c").write_text("#include \"k/go.h\"\nint k_go_avx2(int n) { return k_twice(n); }\n")
    graph = c_module_graph(tmp_path)
    assert graph["k/go_avx2"] == {"k/go"} and graph["k/run"] == {"k/go", "k/go_avx2"}
    assert kernel_circles(graph) == []


def test_no_isa_kernel_of_libtinyloop_reaches_back_up():
    graph = c_module_graph()
    assert {"cpu/matmul", "cpu/matmul_avx2", "cpu/attention_amx", "cpu/rows_avx2", "cpu/rows_avx512"} <= set(graph)
    assert {"cpu/matmul_scalar", "cpu/matmul_amx"} <= graph["cpu/matmul"]  # it sees the calls
    assert {"cpu/rows_avx2", "cpu/rows_avx512", "cpu/attention_avx512"} <= graph["cpu/kernel_tables"]  # and the tables
    assert "cpu/kernel_tables" in graph["cpu/forward"]
    assert kernel_circles(graph) == []
