"""How long the command line takes to answer (issue #14, *answers in seconds*).

Times, in fresh subprocesses, `dlbfluid --help`, `dlbfluid simulate default --json` and
`dlbfluid equilibrium default --json`: each command cold (an empty compilation cache
directory) and then warm (the same directory again). `--tree DIR` runs the code of another
checkout (e.g. a worktree of an older commit, for a before/after in one run); a tree
without the command line's cache still gets the same cache directory through
`DLBFLUID_CACHE_DIR`, which it ignores, so its warm run shows what it did before.

    python benchmarks/cli_latency.py [--tree DIR] [--repeats 2] [--out FILE]

Prints one JSON object (and writes it to `--out`): per command, wall seconds cold and warm
(best of `--repeats` warm runs), the CPU seconds of the child, and whether JAX was imported
by `--help`; a Markdown table on stderr (`_harness.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as H

ROOT = H.ROOT
COMMANDS = {
    "help": ["--help"],
    "simulate": ["simulate", "default", "--json"],
    "equilibrium": ["equilibrium", "default", "--json"],
}


def _time(tree: Path, argv: list[str], cache: str) -> dict:
    r = H.time_cli(tree, argv, cache)
    return {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        parents=[H.parent_parser(repeats=2, repeats_help="warm runs per command (best kept)")],
    )
    p.add_argument("--tree", default=str(ROOT), help="checkout whose code runs (default this)")
    a = H.parse(p, argv)
    tree = Path(a.tree).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree))
    probe = "import sys; from dlbfluid._cli import build_parser; build_parser(); print('jax' in sys.modules)"
    jax_at_help = (
        subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tree
        ).stdout.strip()
        == "True"
    )
    res: dict = {
        "tree": str(tree),
        "cpus": H.environment("cpu_count")["cpu_count"],
        "help_imports_jax": jax_at_help,
        "load_average": (H.loadavg() or [None])[0],
        "commands": {},
    }
    with tempfile.TemporaryDirectory() as cache:
        for name, args in COMMANDS.items():
            cold = _time(tree, args, cache)
            warm = [_time(tree, args, cache) for _ in range(a.repeats)]
            best = min(warm, key=lambda r: r["wall_s"])
            res["commands"][name] = {"cold": cold, "warm": best}
            H.log(f"{name}: cold {cold['wall_s']:.2f} s, warm {best['wall_s']:.2f} s")
    H.emit(res, a.out)
    rows = [
        (name, r["cold"]["wall_s"], r["cold"]["cpu_s"], r["warm"]["wall_s"], r["warm"]["cpu_s"])
        for name, r in res["commands"].items()
    ]
    H.log(
        H.markdown_table(
            ("command", "cold wall s", "cold cpu s", "warm wall s", "warm cpu s"), rows
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
