"""Every code name theory/ cites still exists (issue 31, acceptance).

theory/*.md name the function that computes each formula and the test that checks it. A
module moved or a function renamed leaves such a citation pointing at nothing, so this
test reads every inline code span of theory/*.md (fenced blocks and `$...$` mathematics
left out) and resolves what looks like code:

- a path (`dlbfluid/_simulate/loop.py`, `tests/test_x.py`, `benchmarks/...`) exists; a
  bare file name (`loop.py`) is a file somewhere under dlbfluid/, tests/ or benchmarks/;
- `tests/test_x.py::test_name` names a test defined in that file; a bare `test_name` is
  defined in some file of tests/;
- a dotted path into a package (`dlbfluid._simulate.loop.tick`, `jax.vmap`, `lax.scan`,
  `scipy.optimize.linprog`) imports and has each attribute;
- `Class.attr` names a class of dlbfluid and a member defined in some class body;
- a bare identifier (`simulate`, `local_gain`, `Softplus`, `not_converged`) is a name the
  package or the tests define (function, class, assignment, field, parameter, module), a
  string literal of the package (status names and JSON keys), a builtin, or a name of
  `jax`, `jax.lax` or `jax.numpy`;
- a command-line flag (`--no-progress`) is an option of some `dlbfluid` command, and
  `dlbfluid VERB` a command.

`NOTATION` lists the few spans that are mathematical notation, not code. A stale name is
never added there: theory/ is fixed instead. The resolver is first run on a fake citation
(the negative control), so that it cannot pass by resolving everything.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import re
import warnings
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THEORY = ROOT / "theory"
SEARCHED = ("dlbfluid", "tests", "benchmarks", "examples")

# Spans that are mathematical symbols or prose written in code font, not names of code.
NOTATION = {"A", "C", "W", "f", "eps"}
# Names of code outside Python that theory/ cites: a LAPACK routine, and Trefethen's MATLAB
# function of *Spectral Methods in MATLAB* (the pseudospectral matrix follows it).
# and the `user` line of /usr/bin/time.
ELSEWHERE = {"dgeev", "cheb", "user"}

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"^{_IDENT}(\.{_IDENT})*(\(\))?$")
_CALL = re.compile(rf"^({_IDENT}(\.{_IDENT})*)\(.*\)$")
_FILE = re.compile(r"^[\w./-]+\.(py|md|json|jsonl|ipynb|toml|csv|png|txt)$")
_FLAG = re.compile(r"^--[a-z][a-z0-9-]*$")
_COMMAND = re.compile(r"^dlbfluid ([a-z]+)\b")
# Top-level modules a dotted citation may start with, and the aliases theory/ writes.
_ALIASES = {
    "jr": "jax.random",
    "jnp": "jax.numpy",
    "lax": "jax.lax",
    "np": "numpy",
    "eqx": "equinox",
}
_IMPORTABLE = ("dlbfluid", "jax", "numpy", "scipy", "equinox", "diffrax", "optimistix", "optax")


def spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text, without fenced blocks and `$...$` maths
    (read left to right: a span opened by a backtick ends at the next one, a formula
    opened by a dollar at the next dollar)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        for m in re.finditer(r"`([^`]*)`|(?<!\\)\$[^$]*\$", line):
            if m.group(0).startswith("`"):
                out.append(m.group(1))
    return out


def _files(*tops: str, suffix: str = ".py") -> list[Path]:
    return [p for t in tops for p in sorted((ROOT / t).rglob(f"*{suffix}"))]


@cache
def _parsed(path: Path) -> ast.Module:
    with warnings.catch_warnings():  # a script's invalid escape is not this test's business
        warnings.simplefilter("ignore")
        return ast.parse(path.read_text(), filename=str(path))


@cache
def defined_names(*tops: str) -> frozenset[str]:
    """Every name defined in the `.py` files under `tops`: functions, classes, assignment
    and annotation targets (module, class and function level), parameters, imports,
    module and package names."""
    names: set[str] = set()
    for path in _files(*tops):
        names.add(path.stem)
        names.add(path.parent.name)
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return frozenset(names)


@cache
def class_members() -> dict[str, frozenset[str]]:
    """`{class name: names defined in its body}` for the package's classes."""
    out: dict[str, set[str]] = {}
    for path in _files("dlbfluid"):
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.ClassDef):
                members = out.setdefault(node.name, set())
                for stmt in node.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(stmt.name)
                    elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        members.add(stmt.target.id)
                    elif isinstance(stmt, ast.Assign):
                        members |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return {k: frozenset(v) for k, v in out.items()}


@cache
def string_literals(*tops: str) -> frozenset[str]:
    """The string constants of the `.py` files under `tops` (status names, JSON keys,
    method names, file names the package writes)."""
    return frozenset(
        node.value
        for path in _files(*tops)
        for node in ast.walk(_parsed(path))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


@cache
def _tests_in(path: Path) -> frozenset[str]:
    return frozenset(
        n.name
        for n in ast.walk(_parsed(path))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
    )


@cache
def all_tests() -> frozenset[str]:
    return frozenset(t for p in _files("tests") for t in _tests_in(p))


@cache
def file_names() -> frozenset[str]:
    return frozenset(p.name for t in SEARCHED for p in (ROOT / t).rglob("*") if p.is_file())


@cache
def external_names() -> frozenset[str]:
    """The names of the libraries theory/ cites bare (`vmap`, `fold_in`, `Tsit5`, `eigvals`)."""
    import diffrax
    import jax
    import numpy
    import scipy.linalg

    spaces = (jax, jax.lax, jax.numpy, jax.random, diffrax, numpy, numpy.linalg, numpy.random)
    names = {n for m in (*spaces, scipy.linalg) for n in dir(m)}
    for obj in vars(diffrax).values():  # and diffrax's keywords (`jump_ts`)
        try:
            names |= set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            pass
    return frozenset(names)


@cache
def cli_vocabulary() -> tuple[frozenset[str], frozenset[str]]:
    """(every option string, every command) of the `dlbfluid` command line, with the
    options the benchmark scripts declare."""
    from dlbfluid._cli import build_parser

    flags: set[str] = set()
    commands: set[str] = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands.add(name)
                for a in sub._actions:
                    flags |= set(a.option_strings)
    flags |= {s for s in string_literals("benchmarks") if s.startswith("--")}
    return frozenset(flags), frozenset(commands)


@cache
def module_files() -> dict[str, tuple[Path, ...]]:
    """`{module stem: its files}` (`lyapunov`, `strategy`, `helpers`; a package's
    `__init__.py` under the package's name)."""
    out: dict[str, list[Path]] = {}
    for path in _files(*SEARCHED):
        stem = path.parent.name if path.stem == "__init__" else path.stem
        out.setdefault(stem, []).append(path)
    return {k: tuple(v) for k, v in out.items()}


def _top_level(path: Path) -> set[str]:
    """The names a module defines or imports at its top level (or in its classes)."""
    names: set[str] = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
    return names


def _resolves_dotted(dotted: str) -> bool:
    """An importable module path followed by attributes (`dlbfluid._x.y.name`,
    `jnp.linalg.eigvals`), or a public name of dlbfluid and its attributes
    (`RESULTS.success`)."""
    head, *rest = dotted.split(".")
    parts = _ALIASES.get(head, head).split(".") + rest
    if parts[0] not in _IMPORTABLE:
        parts = ["dlbfluid", *parts]
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return False
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def _defined(name: str) -> bool:
    return (
        name in defined_names(*SEARCHED)
        or name in string_literals("dlbfluid")
        or hasattr(builtins, name)
        or name in external_names()
    )


def unresolved(span: str) -> str | None:
    """None when `span` is not code or resolves; else why it does not."""
    span = span.strip()
    if span in NOTATION or span in ELSEWHERE or not span:
        return None
    words = span.split()
    if m := _COMMAND.match(span):
        if m.group(1) not in cli_vocabulary()[1]:
            return f"no command {m.group(1)!r}"
        return next(
            (
                f"no option {w}"
                for w in words
                if w.startswith("--") and _FLAG.match(w) and w not in cli_vocabulary()[0]
            ),
            None,
        )
    if words[0] == "python" and len(words) > 1 and _FILE.match(words[1]):
        return unresolved(words[1]) or unresolved(" ".join(words[2:]) or "")
    if _FLAG.match(words[0].split("=")[0]):
        flag = words[0].split("=")[0]
        known = flag in cli_vocabulary()[0] or flag.startswith("--xla_")
        return None if known else "no command or benchmark has this option"
    if re.match(rf"^{_IDENT}=", span):  # a keyword argument: its name
        return unresolved(span.split("=")[0])
    if re.match(rf"^\.{_IDENT}$", span):  # a member, as `.tail_of` after its class
        members = set().union(*class_members().values())
        return None if span[1:] in members else "no class defines this member"
    if span[:1] in "'\"" and span[-1:] == span[:1] and len(span) > 1:
        return None if span[1:-1] in string_literals("dlbfluid") else "no such string"
    if span.startswith("/") or (" " in span and not _CALL.match(span)):
        return None  # a command line or a path of the machine, not of the tree
    where, _, name = span.partition("::")
    if _FILE.match(where) or ("/" in where and (ROOT / where.split("/")[0]).is_dir()):
        if "/" not in where:
            known = where in file_names() or where in string_literals("dlbfluid")
            return None if known else "no such file in the tree, nor one the package writes"
        path = ROOT / where
        if not path.exists():
            return "no such path"
        head, *members = name.split(".")
        if head and head not in (_tests_in(path) if head.startswith("test") else _top_level(path)):
            return f"{head!r} is not defined in {where}"
        if any(m not in set().union(*class_members().values()) for m in members):
            return f"no class defines a member of {name!r}"
        return None
    if m := _CALL.match(span):
        span = m.group(1)
    if not _DOTTED.match(span):
        return None  # an expression or a JSON value, not a name
    span = span.removesuffix("()")
    if span.startswith("test_"):
        return None if span in all_tests() else "no such test in tests/"
    if "." not in span:
        return None if _defined(span) else "defined nowhere in the tree nor in its libraries"
    head, *rest = span.split(".")
    if head in class_members():
        members = set().union(*(class_members().values()))
        return None if all(r in members for r in rest) else "no class defines this member"
    if head in module_files() and head not in _IMPORTABLE and head not in _ALIASES:
        found = any(rest[0] in _top_level(p) for p in module_files()[head])
        return None if found else f"{rest[0]!r} is not defined in a module {head!r}"
    if _resolves_dotted(span) or all(_defined(p) for p in span.split(".")):
        return None
    return "does not import"


def citations() -> list[tuple[str, str]]:
    return [(p.name, s) for p in sorted(THEORY.glob("*.md")) for s in spans(p.read_text())]


def test_the_resolver_reports_fake_citations():
    """Negative controls: names that do not exist are reported, each kind of citation."""
    fakes = [
        "dl_fake_function_that_was_renamed",
        "FakeSolverClass",
        "test_a_test_that_was_never_written",
        "tests/test_simulate.py::test_a_test_that_was_never_written",
        "tests/test_no_such_file.py",
        "dlbfluid/_scenario/model.py::no_such_function",
        "helpers.no_such_helper",
        "dlbfluid/_no_such_module.py",
        "dlbfluid._simulate.loop.no_such_function",
        "dlbfluid._no_such_module.tick",
        "Softplus.no_such_method_anywhere",
        "--no-such-option",
        "dlbfluid verify --no-such-option 3",
        "python benchmarks/no_such_script.py --scenarios 2",
        "no_such_keyword=True",
        ".no_such_member",
        "dlbfluid no-such-verb",
        '"no such status string"',
        "no_such_helper(1, 2)",
    ]
    assert {f: unresolved(f) is not None for f in fakes} == {f: True for f in fakes}
    # Positive controls: one real name of each kind.
    real = [
        "simulate",
        "Softplus",
        "test_policy_contract",
        "tests/test_contracts.py::test_policy_contract",
        "tests/test_contracts.py",
        "dlbfluid/_simulate/loop.py",
        "loop.py",
        "dlbfluid.simulate",
        "jax.vmap",
        "lax.while_loop",
        "Softplus.inverse_rate",
        "--json",
        "--step-rule paper",
        "dlbfluid stability FILE --json",
        "python benchmarks/bench_worst_case.py --scenarios 20",
        "allow_overload=True",
        ".tail_of",
        "dlbfluid verify",
        '"nyquist"',
        "two_mm1(2, 1, 1.5, 0.5)",
        "not_converged",
        "RESULTS.success",
        "dlbfluid/_scenario/model.py::replica_scale",
        "helpers.symmetric_pair",
        "results.csv",
    ]
    assert {r: unresolved(r) for r in real} == {r: None for r in real}


def test_spans_skip_fenced_code_and_mathematics():
    text = "a `x_one` b $`not_code`$ c\n```python\n`inside_fence`\n```\n`x_two` $$`m`$$"
    assert spans(text) == ["x_one", "x_two"]


@pytest.mark.parametrize("doc", sorted(p.name for p in THEORY.glob("*.md")))
def test_every_name_theory_cites_exists(doc):
    bad = {s: why for d, s in citations() if d == doc and (why := unresolved(s)) is not None}
    assert not bad, f"theory/{doc} cites names that do not exist: {bad}"
    assert NOTATION <= {s.strip() for _, s in citations()}, "an unused NOTATION entry"
