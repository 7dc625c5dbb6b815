"""Imports run one way (docs in /work/shared/STYLE.md, *Layout*; issue 31, item 2).

The package's module import graph is read from the source with `ast`: a node per module
(`dlbfluid/_x.py` is `dlbfluid._x`, a package is its `__init__.py`), an edge for every
import statement that names a `dlbfluid` module, at module level or inside a function.
`from . import x` and `from ._pkg import name` point at the submodule when `x` or `name` is
one, else at the module they come from; importing `a.b.c` also runs the packages `a.b`
that the importer is not already inside. Imports under `if TYPE_CHECKING:` never run and
are left out (the package's `__init__.py` lists its public names that way), as are the
registry's `"module:attr"` strings, resolved with importlib when a member is first used.

Two rules: the graph has no cycle, and no module outside the command line (`dlbfluid/_cli/`,
whose sub-commands load the numerics lazily so that `--help` answers without JAX) imports a
`dlbfluid` module inside a function, which hides a cycle rather than breaking it. Each
checker is first run on a small synthetic package that breaks its rule, so that it cannot
pass by finding nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dlbfluid"

# Function-local package imports allowed outside the command line: none (each entry would be
# a file `ENTRY.py` or a folder `ENTRY/`). No cycle is allowed anywhere.
LOCAL_IMPORT_ALLOWED: tuple[str, ...] = ()
# The command line imports its sub-commands' numerics inside their functions on purpose.
LAZY_PREFIX = "dlbfluid/_cli/"


def _modules(root: Path, package: str) -> dict[str, Path]:
    """`{dotted module name: file}` for every `.py` file of the package under `root`."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, in_function: bool = False):
    """`(import node, whether it sits inside a function)`, skipping `TYPE_CHECKING` blocks."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), in_function)
        else:
            inner = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            yield from _import_nodes(child, inner)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, modules) -> set[str]:
    """The package modules that `node`, in module `name`, imports by name."""
    if isinstance(node, ast.Import):
        bases = [a.name for a in node.names]
        names: list[str] = []
    else:
        if node.level:
            parts = name.split(".") if is_pkg else name.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        bases = [base]
        names = [a.name for a in node.names]
    found = set()
    for base in bases:
        if base in modules:
            found.add(base)
        for n in names:
            if f"{base}.{n}" in modules:
                found.add(f"{base}.{n}")
    if isinstance(node, ast.ImportFrom) and node.module is None and names:
        # `from . import x` names x only: the package itself is an edge when some name in
        # the list is not a submodule.
        if all(f"{bases[0]}.{n}" in modules for n in names):
            found.discard(bases[0])
    # Importing a.b.c runs the packages a and a.b first, unless the importer is inside them
    # (then they are being imported already).
    for target in list(found):
        parts = target.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if parent in modules and not (name == parent or name.startswith(parent + ".")):
                found.add(parent)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE):
    """`(edges, local)`: `edges[a][b]` is a line of `a` that imports `b`; `local` lists
    `(file, line, module imported)` for every package import inside a function."""
    modules = _modules(root, package)
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    local = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node, in_function in _import_nodes(tree):
            for target in sorted(_targets(node, name, is_pkg, modules)):
                if target != name:
                    edges[name].setdefault(target, node.lineno)
                if in_function:
                    local.append((path.relative_to(root).as_posix(), node.lineno, target))
    return edges, local


def find_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [_cycle_in(comp, edges) for comp in components]


def _cycle_in(component: list[str], edges) -> list[str]:
    """A shortest cycle through the component's first module, as `[a, b, ..., a]`."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v]):
            if w == start:
                return paths[v] + [start]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle in component {component}")  # pragma: no cover


def describe(cycle: list[str], edges) -> str:
    return (
        " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))
        + f" -> {cycle[-1]}"
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_a_cycle_and_a_local_import(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .low import x\n",
            "pkg/low.py": "import os\n\ndef f():\n    from .sub import mod\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/mod.py": "from .. import top\n",
            "pkg/top.py": "from .sub.mod import y\n",
            "pkg/a.py": "from pkg.b import z\n",
            "pkg/b.py": "from . import c\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    edges, local = import_graph(tmp_path, "pkg")
    # `from . import c` and `from .sub import mod` name submodules, and the TYPE_CHECKING
    # import is no edge.
    assert set(edges["pkg.b"]) == {"pkg.c"}
    assert set(edges["pkg.low"]) == {"pkg.sub", "pkg.sub.mod"}
    assert edges["pkg"] == {}
    cycles = find_cycles(edges)
    assert sorted(map(tuple, cycles)) == [
        ("pkg.a", "pkg.b", "pkg.c", "pkg.a"),
        ("pkg.sub.mod", "pkg.top", "pkg.sub.mod"),
    ]
    assert "pkg.a (line 1) -> pkg.b (line 1) -> pkg.c (line 1) -> pkg.a" in [
        describe(c, edges) for c in cycles
    ]
    assert local == [("pkg/low.py", 4, "pkg.sub"), ("pkg/low.py", 4, "pkg.sub.mod")]


def test_no_import_cycles():
    edges, _ = import_graph()
    assert len(edges) > 50  # the walk found the package
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, edges) for c in cycles)


def _allowed(path: str) -> bool:
    return any(path == f"{e}.py" or path.startswith(f"{e}/") for e in LOCAL_IMPORT_ALLOWED)


def test_no_function_local_package_imports():
    _, local = import_graph()
    bad = sorted(
        {
            f"{path}:{line} imports {target}"
            for path, line, target in local
            if not path.startswith(LAZY_PREFIX) and not _allowed(path)
        }
    )
    assert not bad, "function-local package imports:\n" + "\n".join(bad)
    assert any(path.startswith(LAZY_PREFIX) for path, _, _ in local)  # the walk saw them
