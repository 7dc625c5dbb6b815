"""The harness every script in benchmarks/ shares: timing, memory, environment, tables and
the `--out` record.

* **Timing.** `timed(fn, repeats)` makes one warm-up call of `fn` (it compiles), then up
  to `repeats` steady calls (fewer once they add up to `min_time` seconds); every call is
  ended by `jax.block_until_ready` on what `fn` returns. `Timing` keeps the first call,
  the compile seconds inside it (`compile_s`: the union of the `/jax/core/compile/*` time
  spans that `jax.monitoring` reports during the call, robust to run-time noise; also
  `first_minus_best_s`), every steady wall and CPU time (the best wall is `wall_s`), and
  whether a steady call compiled again (`recompiled`). `timed_rounds(fns, repeats)` times
  several functions in interleaved rounds, for ratios between them. `measure(fn)` is one such call,
  `compile_clock()` the compile seconds spent since it was started.
* **Memory.** `memory()`: the process's peak RSS and, where the backend reports them, the
  device's peak and current bytes.
* **Environment.** `environment(*keys)`: devices, device kind, backend, JAX and Python
  versions, platform, core count and load average; `git_state()` (the commit and whether
  dlbfluid/ has uncommitted changes) and `command(argv)` besides.
* **Command line.** `time_cli(tree, argv, cache)`: one `dlbfluid` call in a fresh
  subprocess running `tree`'s code with the compilation cache `cache`: its wall and CPU
  seconds and its stdout (a failure raises with the tail of its stderr).
* **Tables.** `markdown_table(header, rows)`: the table a script prints on stderr, ready to
  paste into benchmarks/README.md.
* **Output.** `header(name, args, env, argv)`: the keys a record starts with (its name,
  options, environment, git state and command). `parent_parser()` gives every script `--out` (and `--repeats` where asked);
  `parse(p, argv)` refuses a bad `--out` before any work starts (a directory, a missing or
  read-only folder); `emit(record, out)` prints the JSON record on stdout and writes it to
  `--out` atomically (a temporary file in the same folder, then a rename), so that an
  interrupted run never leaves half a record.

Importing this module puts the checkout's root first on `sys.path`, so that a script runs
the `dlbfluid` of the tree it sits in, installed or not (`add_tests_to_path` does the same
for tests/, whose reference implementations some scripts use as peers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402


def add_tests_to_path() -> None:
    """Make tests/'s modules (`helpers`, `reference`, `cvxpy_reference`) importable."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def log(msg: str) -> None:
    """One line on stderr, flushed (the JSON record owns stdout)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------

_SPANS: list[tuple[str, float, float]] = []
_LISTENING: list[bool] = []


def _on_span(name: str, start: float, end: float, **_: Any) -> None:
    _SPANS.append((name, start, end))


def _union(spans: Sequence[tuple[str, float, float]]) -> float:
    """Length of the union of the compile-related intervals among `spans`."""
    total, hi = 0.0, -math.inf
    for s, e in sorted((s, e) for name, s, e in spans if name.startswith("/jax/core/compile/")):
        if e > hi:
            total += e - max(s, hi)
            hi = e
    return total


@dataclasses.dataclass
class CompileClock:
    """The compile seconds spent since `compile_clock()` returned this clock."""

    start: int

    def seconds(self) -> float:
        return _union(_SPANS[self.start :])


def compile_clock() -> CompileClock:
    """Start counting compile seconds (the `/jax/core/compile/*` spans from now on)."""
    if not _LISTENING:
        jax.monitoring.register_event_time_span_listener(_on_span)
        _LISTENING.append(True)
    return CompileClock(len(_SPANS))


@dataclasses.dataclass
class Call:
    """One call: its result, wall and CPU seconds, and the compile seconds inside it
    (at most the wall)."""

    result: Any
    wall_s: float
    compile_s: float
    cpu_s: float


def measure(fn: Callable[[], Any]) -> Call:
    """Call `fn()` once and wait for its arrays (`jax.block_until_ready`)."""
    clock = compile_clock()
    t0, c0 = time.perf_counter(), time.process_time()
    result = jax.block_until_ready(fn())
    wall = time.perf_counter() - t0
    return Call(result, wall, min(clock.seconds(), wall), time.process_time() - c0)


@dataclasses.dataclass
class Timing:
    """A warm-up call and the steady calls after it (see `timed`)."""

    result: Any
    first_call_s: float | None
    compile_s: float | None
    walls_s: list[float]
    cpus_s: list[float]
    recompiled: bool

    @property
    def wall_s(self) -> float:
        """The best steady wall."""
        return min(self.walls_s)

    @property
    def first_minus_best_s(self) -> float:
        """The warm-up call's excess over the best steady call (0 without a warm-up)."""
        return 0.0 if self.first_call_s is None else max(self.first_call_s - self.wall_s, 0.0)


def timed(
    fn: Callable[[], Any],
    repeats: int,
    *,
    min_time: float = math.inf,
    warm_up: bool = True,
    net_of_compile: bool = False,
) -> Timing:
    """A warm-up call of `fn` (skipped with `warm_up=False`, where an earlier call already
    compiled), then steady calls until `repeats` of them or until they add up to
    `min_time` seconds (at least one). `net_of_compile`: each steady wall less the
    compile seconds inside it (for a program that may compile again, as MNLB's does when
    the horizon changes). `result` is the last call's."""
    if repeats < 1:
        raise ValueError(f"repeats = {repeats} is invalid: expected an integer >= 1")
    first = measure(fn) if warm_up else None
    result = None if first is None else first.result
    walls: list[float] = []
    cpus: list[float] = []
    recompiled = False
    while len(walls) < repeats and (not walls or sum(walls) < min_time):
        result = None  # (one result alive at a time)
        c = measure(fn)
        walls.append(c.wall_s - c.compile_s if net_of_compile else c.wall_s)
        cpus.append(c.cpu_s)
        recompiled |= c.compile_s > 0.05
        result = c.result
    return Timing(
        result,
        None if first is None else first.wall_s,
        None if first is None else first.compile_s,
        walls,
        cpus,
        recompiled,
    )


def timed_rounds(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    """`timed` for several functions whose times are compared: a warm-up call of each,
    then `repeats` rounds that call every function once in turn, so that a slow phase of
    the machine falls on every function alike rather than on the one timed then. Each
    `Timing`'s `result` is its function's last call's."""
    if repeats < 1:
        raise ValueError(f"repeats = {repeats} is invalid: expected an integer >= 1")
    first = {name: measure(fn) for name, fn in fns.items()}
    results = {name: c.result for name, c in first.items()}
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpus: dict[str, list[float]] = {name: [] for name in fns}
    recompiled = dict.fromkeys(fns, False)
    for _ in range(repeats):
        for name, fn in fns.items():
            results[name] = None  # (one result of each alive at a time)
            c = measure(fn)
            walls[name].append(c.wall_s)
            cpus[name].append(c.cpu_s)
            recompiled[name] |= c.compile_s > 0.05
            results[name] = c.result
    return {
        name: Timing(results[name], first[name].wall_s, first[name].compile_s, walls[name],
                     cpus[name], recompiled[name])  # fmt: skip
        for name in fns
    }


# ----------------------------------------------------------------------------------------
# Memory and environment
# ----------------------------------------------------------------------------------------


def memory() -> dict:
    """Peak RSS of this process and, where the backend reports them (accelerators),
    device 0's peak, current and limit bytes (`memory_stats()`)."""
    out: dict[str, Any] = {
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    }
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats:
        out["device_peak_bytes"] = stats.get("peak_bytes_in_use")
        out["device_bytes_in_use"] = stats.get("bytes_in_use")
        out["device_bytes_limit"] = stats.get("bytes_limit")
        out["source"] = "jax.devices()[0].memory_stats()"
    else:
        out["device_peak_bytes"] = None
        out["source"] = "host peak RSS (the backend reports no device memory statistics)"
    return out


def loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def git_state() -> dict:
    """The commit of the checkout and whether dlbfluid/ differs from it (uncommitted
    changes make a result specific to that working tree)."""

    def git(*a):
        r = subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
        )
        return r.stdout.strip() if r.returncode == 0 else None

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dlbfluid_uncommitted_changes": bool(git("status", "--porcelain", "dlbfluid")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dlbfluid_uncommitted_changes": None}


def command(argv: Sequence[str] | None) -> str | None:
    """The command line that ran the script (`None` when `main` was called with `argv`)."""
    if argv is not None:
        return None
    script = Path(sys.argv[0]).resolve()
    name = script.relative_to(ROOT) if script.is_relative_to(ROOT) else Path(sys.argv[0])
    return " ".join([str(name)] + sys.argv[1:])


def header(name: str, args: argparse.Namespace, env: dict, argv: Sequence[str] | None) -> dict:
    """The keys every record starts with: `benchmark` (the script's name), `config` (its
    options but `--out`), `environment` (`env`, taken before the timings), `git`
    (`git_state`) and `command` (`command`)."""
    return {
        "benchmark": name,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": env,
        "git": git_state(),
        "command": command(argv),
    }


_ENVIRONMENT: dict[str, Callable[[], Any]] = {
    "devices": lambda: [str(d) for d in jax.devices()],
    "device_kind": lambda: jax.devices()[0].device_kind,
    "backend": jax.default_backend,
    "jax_version": lambda: jax.__version__,
    "python": platform.python_version,
    "platform": platform.platform,
    "cpu_count": os.cpu_count,
    "loadavg_start": loadavg,
}


def environment(*keys: str) -> dict:
    """The machine a record was measured on, under the keys asked for (all by default):
    `devices`, `device_kind`, `backend`, `jax_version`, `python`, `platform`, `cpu_count`,
    `loadavg_start`."""
    unknown = [k for k in keys if k not in _ENVIRONMENT]
    if unknown:
        raise ValueError(f"environment keys {unknown} are invalid: allowed {list(_ENVIRONMENT)}")
    return {k: _ENVIRONMENT[k]() for k in keys or _ENVIRONMENT}


# ----------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """A Markdown table, columns padded to line up in a terminal. `align`: one letter per
    column, `l` or `r` (default: the first column left, the others right)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    k = len(header)
    bad = [r for r in cells if len(r) != k]
    if bad:
        raise ValueError(f"table row {bad[0]} has {len(bad[0])} cells: expected {k}")
    align = align or "l" + "r" * (k - 1)
    if len(align) != k or set(align) - {"l", "r"}:
        raise ValueError(f"align = {align!r} is invalid: expected {k} letters l or r")
    w = [max(3, *(len(r[j]) for r in cells)) for j in range(k)]

    def line(r):
        return "| " + " | ".join(c.ljust(w[j]) if align[j] == "l" else c.rjust(w[j]) for j, c in enumerate(r)) + " |"  # fmt: skip

    rule = "|" + "|".join("-" * (w[j] + 1) + (":" if align[j] == "r" else "-") for j in range(k))
    return "\n".join([line(cells[0]), rule + "|", *map(line, cells[1:])])


# ----------------------------------------------------------------------------------------
# The command line in a subprocess
# ----------------------------------------------------------------------------------------

CLI = "import sys; from dlbfluid._cli import main; sys.exit(main(sys.argv[1:]))"


def time_cli(tree: str | os.PathLike, argv: Sequence[str], cache: str) -> dict:
    """Run `dlbfluid ARGV` in a fresh subprocess on `tree`'s code (`PYTHONPATH`, working
    directory `tree`) with `DLBFLUID_CACHE_DIR=cache`: `{"wall_s", "cpu_s", "stdout"}`, the
    CPU seconds the child used (all threads). Raises `RuntimeError` with the tail of its
    stderr if it fails."""
    env = dict(os.environ, PYTHONPATH=str(tree), DLBFLUID_CACHE_DIR=cache, MPLBACKEND="Agg")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CLI, *argv], env=env, capture_output=True, text=True, cwd=tree
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{list(argv)} failed ({p.returncode}): {p.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "stdout": p.stdout}


# ----------------------------------------------------------------------------------------
# --out and the JSON record
# ----------------------------------------------------------------------------------------


def parent_parser(
    *, repeats: int | None = None, repeats_help: str = "steady calls, best kept"
) -> argparse.ArgumentParser:
    """`--out FILE` and, with a default for it, `--repeats N`: pass as
    `argparse.ArgumentParser(parents=[parent_parser(...)])`."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="also write the JSON record here (its folder must exist and be writable)",
    )
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} ({repeats})")
    return p


def check_out(p: argparse.ArgumentParser, path: str | None) -> None:
    """Refuse `--out` through `p.error` unless it is a writable file path in an existing
    folder: checked before any work, so that an hour's run cannot fail at its last line."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        p.error(f"--out {path}: is a directory (allowed: a file path)")
    parent = out.resolve().parent
    if not parent.is_dir():
        p.error(f"--out {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        p.error(f"--out {path}: not writable")


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`p.parse_args(argv)`, then `--repeats` (>= 1) and `--out` (`check_out`) checked."""
    a = p.parse_args(argv)
    repeats = getattr(a, "repeats", None)
    if repeats is not None and repeats < 1:
        p.error(f"--repeats {repeats}: is invalid: expected an integer >= 1")
    check_out(p, getattr(a, "out", None))
    return a


def write_json(record: Any, path: str | os.PathLike, *, indent: int | None = 2, default=None):
    """Write `record` as JSON to `path` atomically: a temporary file in the same folder,
    flushed to disk, then renamed over `path`."""
    path = Path(path)
    text = json.dumps(record, indent=indent, default=default) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(
    record: Any,
    out: str | None = None,
    *,
    indent: int | None = 2,
    out_indent: int | None | str = "same",
    default=None,
) -> Any:
    """Print `record` as JSON on stdout and, with `out`, write it there (`write_json`, with
    `out_indent`, by default the same as `indent`). Returns `record`."""
    print(json.dumps(record, indent=indent, default=default), flush=True)
    if out:
        write_json(
            record, out, indent=indent if out_indent == "same" else out_indent, default=default
        )
    return record
