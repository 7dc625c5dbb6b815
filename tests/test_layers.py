"""The package's folders form layers, and imports only run down them (issue 31, item 1).

`LAYERS` is docs/layout.md (the *Layout* page) as data: a folder (or base module) may
import only the folders listed before it, so that the order reads as the design (base,
runtime, model, numerics, pipelines, command line). The module graph comes from the same
`ast` reader as the import-circle test (`test_import_graph.import_graph`); an edge between
two modules of the same top-level folder is that folder's own business (the circle test
covers it). The checker is first run on a synthetic package with an upward import, so that
it cannot pass by finding nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_import_graph import PACKAGE, ROOT, import_graph

# (layer, its top-level modules in the order they may import each other). "" is the
# package's own `__init__.py` (which imports nothing at run time: its public names load
# lazily).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "",
            "_errors",
            "_results",
            "_precision",
            "_shapes",
            "_elementary",
            "_defaults",
            "_validate",
            "_registry",
            "_plot",
        ),
    ),
    ("runtime", ("_runtime",)),
    ("model", ("_service", "_scenario", "_costs", "_policies")),
    (
        "numerics",
        (
            "_integrators",
            "_simulate",
            "_requests",
            "_equilibrium",
            "_stability",
            "_theorem1",
            "_global_threshold",
        ),
    ),
    ("pipelines", ("_evaluation", "_verify")),
    ("command line", ("_cli",)),
)


def _top(module: str, package: str) -> str:
    """`dlbfluid._simulate.loop` -> `_simulate`; the package itself -> `""`."""
    rest = module[len(package) :].lstrip(".")
    return rest.split(".")[0]


def upward_imports(root: Path, package: str, layers) -> list[str]:
    """Every import from a top-level module to one listed at or after it in `layers`
    (`a -> b (line n)`), and every top-level module that `layers` does not place."""
    order = [m for _, members in layers for m in members]
    rank = {m: k for k, m in enumerate(order)}
    edges, _ = import_graph(root, package)
    bad = []
    for a, targets in sorted(edges.items()):
        ta = _top(a, package)
        if ta not in rank:
            bad.append(f"{a}: its folder {ta!r} is in no layer")
            continue
        for b, line in sorted(targets.items()):
            tb = _top(b, package)
            if tb != ta and tb in rank and rank[tb] > rank[ta]:
                bad.append(f"{a} -> {b} (line {line}): {tb} is listed after {ta}")
    return bad


def test_imports_run_down_the_layers():
    bad = upward_imports(ROOT, PACKAGE, LAYERS)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_checker_finds_an_upward_import_and_an_unplaced_folder(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/_low.py": "from ._high import x\n",  # upward: _low is listed first
        "pkg/_high/__init__.py": "from .. import _low\n",
        "pkg/_stray.py": "",
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    bad = upward_imports(tmp_path, "pkg", (("a", ("", "_low")), ("b", ("_high",))))
    assert bad == [
        "pkg._low -> pkg._high (line 1): _high is listed after _low",
        "pkg._stray: its folder '_stray' is in no layer",
    ]
    assert upward_imports(tmp_path, "pkg", (("a", ("", "_low", "_high", "_stray")),)) == [
        "pkg._low -> pkg._high (line 1): _high is listed after _low"
    ]


def test_the_layout_page_lists_the_same_layers():
    """docs/layout.md names every layer and every folder of `LAYERS`, in order."""
    text = (ROOT / "docs" / "layout.md").read_text()
    section = text.split("# Layout", 1)[1].split("\n## ", 1)[0]
    positions = []
    for layer, members in LAYERS:
        for m in [m for m in members if m]:
            hit = re.search(rf"`{re.escape(m)}/?`", section)
            assert hit, f"docs/layout.md does not name `{m}` (layer {layer})"
            positions.append(hit.start())
    assert positions == sorted(positions), "docs/layout.md lists the folders out of order"
