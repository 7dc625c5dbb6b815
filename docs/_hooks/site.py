"""The documentation site's build hook (mkdocs.yml, `hooks:`).

Three jobs, each a mkdocs event:

- `on_files` mounts the files that live outside docs/ (theory/, notebooks/, the benchmark
  pages, CHANGELOG.md) at the same paths in the site, so they are rendered in place and
  their relative links between each other keep working; nothing is copied or symlinked.
- `on_page_markdown` expands `<!-- cli-options: COMMAND -->` into the table of that
  command's options, generated from `dlbfluid._cli.build_parser` (`cli_reference.py`).
- `on_page_content` turns every equation into MathML at build time (`latex2mathml`):
  `$...$` and `$$...$$` in Markdown pages and docstrings (marked by pymdownx.arithmatex in
  generic mode) and in the notebooks' Markdown cells, whose MathJax loader is removed.
  `on_post_build` then fails the build if a page loads a script, a stylesheet or a font
  from another host, or if no equation was rendered: the site must work offline.
"""

from __future__ import annotations

import html
import importlib.util
import pathlib
import re
import sys

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Files outside docs/ that the site renders where they are (glob patterns, repository root).
MOUNTED = (
    "theory/*.md",
    "notebooks/*.ipynb",
    "benchmarks/README.md",
    "benchmarks/HISTORY.md",
    "CHANGELOG.md",
)


def _load(name: str):
    # A sibling module, loaded by path: the hook runs with no package around it.
    spec = importlib.util.spec_from_file_location(
        name, pathlib.Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The options tables describe this checkout's parser, not an installed copy's.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
_cli_reference = _load("cli_reference")


@event_priority(100)  # before mkdocs-jupyter's on_files, which claims the notebooks
def on_files(files: Files, config) -> Files:
    for pattern in MOUNTED:
        paths = sorted(ROOT.glob(pattern))
        if not paths:
            raise PluginError(f"docs/_hooks/site.py: nothing matches {pattern!r} under {ROOT}")
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            if files.get_file_from_path(rel) is not None:
                raise PluginError(f"{rel} exists both in docs/ and in the repository root")
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


_OPTIONS = re.compile(r"<!--\s*cli-options:\s*([\w-]+)\s*-->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    def table(m: re.Match) -> str:
        try:
            return _cli_reference.options_table(m.group(1))
        except KeyError as e:
            raise PluginError(f"{page.file.src_uri}: {e.args[0]}") from None

    return _OPTIONS.sub(table, markdown)


# pymdownx.arithmatex (generic): \( ... \) in a span, \[ ... \] in a div. A `$$...$$` that
# does not stand in a paragraph of its own (theory/ and the docstrings write display
# equations inside their sentences, as GitHub renders them) comes out as `$`, an inline
# span, `$`: the optional dollars around the span make it a display equation again.
_ARITHMATEX = re.compile(
    r'(\$?)<(span|div) class="arithmatex">\s*(?:\\\((.*?)\\\)|\\\[(.*?)\\\])\s*</\2>(\$?)',
    re.S,
)
# A notebook's Markdown cell as nbconvert writes it; the equations are left as typed.
_NB_MARKDOWN = re.compile(r'(<div class="[^"]*jp-RenderedMarkdown[^"]*"[^>]*>)(.*?)(</div>)', re.S)
_NB_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?!\s)(.+?)(?<![\s\\])\$", re.S)
_MATHJAX = re.compile(
    r"<script[^>]*>(?:(?!</script>).)*?MathJax(?:(?!</script>).)*?</script>", re.S
)
_MATHJAX_SRC = re.compile(r'<script[^>]*src="[^"]*mathjax[^"]*"[^>]*>\s*</script>', re.S | re.I)

_rendered = {"math": 0}


def to_mathml(tex: str, display: bool, where: str) -> str:
    """MathML for one LaTeX equation; a formula latex2mathml cannot read fails the build."""
    try:
        out = convert(tex.strip(), display="block" if display else "inline")
    except Exception as e:
        raise PluginError(f"{where}: cannot render ${tex.strip()}$ as MathML: {e!r}") from None
    _rendered["math"] += 1
    return out


def on_page_content(content: str, page, config, files) -> str:
    where = page.file.src_uri

    def arithmatex(m: re.Match) -> str:
        before, inline, block, after = m.group(1), m.group(3), m.group(4), m.group(5)
        tex = html.unescape(inline if inline is not None else block)
        if inline is not None and before and after:  # `$$...$$` inside a paragraph
            return to_mathml(tex, True, where)
        return before + to_mathml(tex, block is not None, where) + after

    content = _ARITHMATEX.sub(arithmatex, content)
    if where.endswith(".ipynb"):
        content = _MATHJAX.sub("", content)
        content = _MATHJAX_SRC.sub("", content)

        def cell(m: re.Match) -> str:
            def one(e: re.Match) -> str:
                block = e.group(1) is not None
                tex = html.unescape(e.group(1) if block else e.group(2))
                return to_mathml(tex, block, where)

            return m.group(1) + _NB_MATH.sub(one, m.group(2)) + m.group(3)

        content = _NB_MARKDOWN.sub(cell, content)
    return content


_HOST = r"[\"']?(?:https?:)?//"  # an address on another host, quoted or not
_REMOTE = re.compile(
    "|".join(
        [
            rf"<(?:script|img|iframe)[^>]+src={_HOST}",
            rf"<link[^>]+href={_HOST}[^>]*rel=[\"']?(?:stylesheet|preload|preconnect)",
            rf"<link[^>]+rel=[\"']?(?:stylesheet|preload|preconnect)[^>]+href={_HOST}",
            rf"@import\s+url\({_HOST}",
        ]
    ),
    re.I,
)


def check_offline(site: pathlib.Path) -> int:
    """Raise if a built page loads a script, image, frame, stylesheet or font from another
    host; return the number of pages holding `<math>`."""
    with_math = 0
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        hit = _REMOTE.search(text)
        if hit:
            rel = page.relative_to(site)
            raise PluginError(f"{rel} loads from the network: {hit.group(0)[:120]!r}")
        with_math += "<math" in text
    return with_math


def on_post_build(config) -> None:
    with_math = check_offline(pathlib.Path(config["site_dir"]))
    if with_math == 0 or _rendered["math"] == 0:
        raise PluginError("no page holds an equation rendered as <math>")
    sys.stderr.write(
        f"INFO    -  docs/_hooks/site.py: {_rendered['math']} equations as MathML on "
        f"{with_math} pages; no page loads from the network\n"
    )
    _rendered["math"] = 0
