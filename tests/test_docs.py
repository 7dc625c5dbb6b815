"""The documentation stays in step with the code (issue 43), without building the site.

The README is short and keeps the two quick-start commands verbatim; the command-line page
has a generated options table for every command of `build_parser()`, and the generator
gives a row for every option; every public name has its reference entry; every theory file
and notebook is in the site's navigation. `mkdocs build --strict` (.ci/run) checks the
rest: links, anchors, docstrings, equations rendered to MathML, nothing loaded from the
network."""

import importlib.util
import re
from pathlib import Path

import pytest

import dlbfluid

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
QUICK_START = ("pip install . && dlbfluid demo", 'pip install ".[test]" && python -m pytest -q')


def _cli_reference():
    path = DOCS / "_hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_short_and_keeps_the_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    # Each command alone in its own block, exactly as typed; no other install command.
    for command in QUICK_START:
        assert f"{command}\n" in blocks, command
    assert [b for b in blocks if "pytest" in b or "dlbfluid demo" in b] == [
        f"{c}\n" for c in QUICK_START
    ]
    assert "mkdocs serve" in text and "mkdocs build" in text


def test_ci_runs_the_readme_test_command_and_builds_the_site():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert QUICK_START[1] in ci
    assert "mkdocs build --strict" in ci
    assert ci.index(QUICK_START[1]) < next(
        i for i, line in enumerate(ci) if line.startswith("mkdocs build")
    )


def test_cli_page_has_a_generated_table_for_every_command():
    ref = _cli_reference()
    page = (DOCS / "cli.md").read_text()
    marked = re.findall(r"<!--\s*cli-options:\s*([\w-]+)\s*-->", page)
    commands = list(ref.subcommands())
    assert commands and sorted(marked) == sorted(commands)
    for command in commands:
        table = ref.options_table(command)
        names = ref.option_strings(command)
        assert names
        for name in names:
            assert f"`{name}`" in table, (command, name)
        # One row per argument besides --help, nothing else.
        assert len([ln for ln in table.splitlines() if ln.startswith("| `")]) == len(
            ref.rows(command)
        )
        # The page's section for the command names it in its heading.
        assert f"## `dlbfluid {command}`" in page


def test_cli_generator_refuses_an_unknown_command():
    with pytest.raises(KeyError, match="no command 'simulat'"):
        _cli_reference().options_table("simulat")


def test_every_public_name_has_a_reference_entry():
    entries = []
    for page in sorted((DOCS / "api").glob("*.md")):
        entries += re.findall(r"^::: dlbfluid\.(\w+)\s*$", page.read_text(), re.M)
    assert sorted(entries) == sorted(set(entries)), "a name documented twice"
    assert set(entries) == set(dlbfluid.__all__)


def test_theory_and_notebooks_are_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    files = sorted((ROOT / "theory").glob("*.md")) + sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        assert re.search(rf"^\s+- (?:[^:\n]+: )?{re.escape(rel)}$", nav, re.M), rel
