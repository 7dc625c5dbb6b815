"""The command line's options as Markdown tables, read from `dlbfluid._cli.build_parser`.

docs/cli.md holds one `<!-- cli-options: COMMAND -->` line per command; the site hook
(`site.py`) replaces it with `options_table(COMMAND)`, so the page lists exactly the
options argparse accepts. tests/test_docs.py checks that every command has its line and
every option its row. Plain Python: no mkdocs needed.
"""

from __future__ import annotations

import argparse

from dlbfluid._cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The parser of every `dlbfluid COMMAND`, by command name, in registration order."""
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("dlbfluid's parser has no subcommands")


def _arguments(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]


def _cell(text: str) -> str:
    # One table cell: no line breaks, no column separator, no `$` read as an equation.
    return " ".join(text.split()).replace("|", "\\|").replace("$", "\\$")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        value = "{" + ", ".join(str(c) for c in action.choices) + "}"
    elif action.metavar is not None:
        value = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    else:
        value = action.dest.upper()
    if action.nargs in ("+", "*"):
        value += " ..."
    return f"`{_cell(value)}`"


def _default(action: argparse.Action) -> str:
    if action.option_strings == [] or action.nargs == 0:
        return ""
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    default = action.default
    if isinstance(default, list | tuple):
        default = " ".join(str(d) for d in default)
    return f"`{default}`"


def rows(command: str) -> list[tuple[str, str, str, str]]:
    """(argument, value, default, help) for every argument of `command`, help excluded."""
    commands = subcommands()
    if command not in commands:
        raise KeyError(f"no command {command!r}; the commands are {', '.join(commands)}")
    sub = commands[command]
    formatter = sub._get_formatter()
    out = []
    for action in _arguments(sub):
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest.upper()}`"
        text = formatter._expand_help(action) if action.help else ""
        out.append((name, _value(action), _default(action), _cell(text)))
    return out


def options_table(command: str) -> str:
    """The Markdown table of `dlbfluid COMMAND`'s arguments, as `dlbfluid COMMAND --help`
    describes them."""
    lines = [
        f"Options of `dlbfluid {command}` (from `dlbfluid {command} --help`):",
        "",
        "| argument | value | default | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {v} | {d} | {h} |" for a, v, d, h in rows(command)]
    return "\n".join(lines) + "\n"


def option_strings(command: str) -> list[str]:
    """Every option string (`--json`, `-h` excluded) and positional name of `command`."""
    sub = subcommands()[command]
    names = []
    for action in _arguments(sub):
        names += action.option_strings or [action.metavar or action.dest.upper()]
    return names
