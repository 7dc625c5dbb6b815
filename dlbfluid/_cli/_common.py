"""Pieces shared by the sub-commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .._defaults import PROBE_TICK


def load_scenario_arg(path: str, *, allow_overload: bool = False, command: str | None = None):
    """A scenario from a path, or the built-in default for the literal name `default`.

    Demand beyond capacity (Assumption 2) is refused unless `allow_overload`, with a remedy
    that fits `command`: `simulate` accepts `--allow-overload`; the equilibrium and
    stability commands need demand strictly within capacity and point to `simulate`.
    """
    from .._scenario import _check_capacity, default_scenario, load_scenario

    if path == "default":
        scn = default_scenario()
    else:
        scn = load_scenario(path, allow_overload=True)
    if not allow_overload:
        if command == "simulate":
            remedy = "or pass --allow-overload to simulate overload on purpose."
        elif command is not None:
            remedy = (
                f"`dlbfluid {command}` needs demand strictly within capacity (no equilibrium "
                "exists otherwise); `dlbfluid simulate --allow-overload` simulates overload."
            )
        else:
            remedy = None
        _check_capacity(scn, remedy=remedy)
    return scn


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def emit_json(obj, stream=None) -> None:
    """Exactly one JSON object on stdout (non-finite numbers become null)."""
    stream = sys.stdout if stream is None else stream
    stream.write(json.dumps(_clean(obj)) + "\n")
    stream.flush()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(_clean(obj), indent=2) + "\n")


# ----------------------------------------------------------------------------------------
# argparse `type=` functions: argparse reports "argument --NAME: VALUE is invalid: ..." and
# exits with status 2 before any work. Each returns a plain int or float (the options are
# compared across processes as JSON).
# ----------------------------------------------------------------------------------------


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a number") from None


def _typed(parse, name: str):
    parse.__name__ = name
    return parse


def positive_float(name: str):
    """A finite number > 0."""

    def parse(text: str) -> float:
        v = _number(text)
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number > 0")
        return v

    return _typed(parse, name)


def nonneg_float(name: str):
    """A finite number >= 0."""

    def parse(text: str) -> float:
        v = _number(text)
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number >= 0")
        return v

    return _typed(parse, name)


def fraction(name: str):
    """A number in (0, 1]."""

    def parse(text: str) -> float:
        v = _number(text)
        if not 0 < v <= 1:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a number in (0, 1]")
        return v

    return _typed(parse, name)


def int_in(name: str, lo: int, hi: int | None = None, why: str = "", shown: str = ""):
    """An integer `lo <= v <= hi` (written in decimal: `10`, not `1e1` or `10.0`);
    `shown` replaces the range in messages (e.g. "[0, 2**63)")."""

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
            if shown:
                allowed = f"an integer in {shown}"
            raise argparse.ArgumentTypeError(
                f"{text!r} is invalid: expected {allowed}{f' ({why})' if why else ''}"
            )
        return v

    return _typed(parse, name)


def integer(name: str):
    """Any integer (a range checked later, with the other options' combinations)."""

    def parse(text: str) -> int:
        try:
            return int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer") from None

    return _typed(parse, name)


def positive_int(name: str, hi: int | None = None, why: str = ""):
    """An integer >= 1 (and <= `hi`)."""
    return int_in(name, 1, hi, why)


def nonneg_int(name: str, hi: int | None = None, why: str = ""):
    """An integer >= 0 (and <= `hi`)."""
    return int_in(name, 0, hi, why)


SEED_MAX = 2**63 - 1
"""Largest `--seed` (the generator's streams are keyed by a 64-bit integer)."""


def seed_int(name: str = "seed"):
    """A random stream: an integer in [0, 2**63 - 1]."""
    return int_in(name, 0, SEED_MAX, "a 64-bit stream key", shown="[0, 2**63)")


# ----------------------------------------------------------------------------------------
# Checks of combinations and paths, before any work (ValueError: `main` exits with 2)
# ----------------------------------------------------------------------------------------


def check_out_dir(path: str | None, flag: str = "--out") -> Path | None:
    """Check, before any work, that `path` is (or can be made) a writable directory:
    creates it and returns it, or raises `ValueError` naming `flag`, the value and what is
    allowed (an existing file, an uncreatable or unwritable directory)."""
    if path is None:
        return None
    out = Path(path)
    if str(path) == "":
        raise ValueError(f"{flag} = '' is invalid: expected a directory path")
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: it is an existing file; expected a directory "
            "(existing or new)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        why = f"{str(blocker)!r} is a file" if blocker is not None else (e.strerror or str(e))
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: the directory cannot be created ({why}); "
            "expected a writable directory"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: the directory is not writable; "
            "expected a writable directory"
        )
    return out


def check_out_dir_on_main(args, path: str | None, flag: str = "--out") -> Path | None:
    """`check_out_dir` on process 0 (the only one that writes), its verdict told to every
    process of the run (`args.processes`), so that all of them stop together, before any
    work, when process 0's directory is unusable."""
    procs = getattr(args, "processes", None)
    error, out = None, None
    if procs is None or procs.main:
        try:
            out = check_out_dir(path, flag)
        except ValueError as e:
            error = str(e)
    if procs is not None and procs.count > 1:
        error = procs.broadcast(error, "cli/check-out")
    if error:
        raise ValueError(error)
    return out


def check_whole_ticks(horizon: float, tick: float, flag: str = "--horizon") -> int:
    """The number of ticks in `horizon`, or `ValueError` naming `flag` when the horizon is
    not a whole number of ticks (checked before any work)."""
    K = int(round(horizon / tick))
    if K < 1 or abs(K * tick - horizon) > 1e-9 * horizon:
        raise ValueError(
            f"{flag} = {horizon:g} is invalid: expected a whole number of ticks (at least one) "
            f"of --tick = {tick:g} s"
        )
    return K


def check_min_max(lo: int, hi: int, lo_flag: str, hi_flag: str) -> None:
    """`ValueError` naming both flags unless `lo <= hi`."""
    if lo > hi:
        raise ValueError(
            f"{lo_flag} = {lo}, {hi_flag} = {hi} is invalid: expected {lo_flag} <= {hi_flag}"
        )


STEP_TICK_WARN = 1.0
"""`eta * h` above which `step_size_warning` warns (see there)."""


def step_size_warning(step_size: float, tick: float) -> str | None:
    """A warning when the flow-routing step is so large that the projection dominates.

    The update is $x \\leftarrow \\mathrm{Proj}(x - \\eta h c)$: once $\\eta h > 1$, a cost
    gap of one unit (1 s of latency, one request per replica) moves more than a source's
    whole traffic in one tick, so every update lands on a face of the simplex and flow
    routing behaves like best response. Such step sizes are legal (the critical step size
    of `dlbfluid stability` says where stability is lost); this only says so.
    """
    if step_size * tick > STEP_TICK_WARN:
        return (
            f"--step-size = {step_size:g} with --tick = {tick:g} s gives eta*h = "
            f"{step_size * tick:g} > {STEP_TICK_WARN:g}: a cost gap of 1 moves more than all "
            "of a source's traffic in one tick, so the projection dominates and flow routing "
            "acts like best response (see `dlbfluid stability` for the critical step size)"
        )
    return None


def warn(command: str, message: str) -> None:
    """One warning line on stderr, `dlbfluid COMMAND: warning: ...` (the run goes on)."""
    print(f"dlbfluid {command}: warning: {message}", file=sys.stderr, flush=True)


def doing(command: str, what: str) -> None:
    """One line on stderr saying what a command is about to compute, and whether it may
    compile first (the persistent cache, `dlbfluid._runtime.cache`, makes a second call with the
    same shapes load its programs instead): a slow first call never runs silently, and a
    warm one does not claim to compile."""
    import jax

    print(
        f"dlbfluid {command}: {what} "
        f"({compile_note(getattr(jax.config, 'jax_compilation_cache_dir', None))})",
        file=sys.stderr,
        flush=True,
    )


def compile_note(cache: str | None) -> str:
    """Whether a command's programs compile or come from the compilation cache `cache`:
    off, empty (a first run: everything compiles) or holding programs (a later run: loaded,
    only shapes not seen before compile)."""
    if not cache:
        return "compiles first: the compilation cache is off"
    try:
        with os.scandir(cache) as entries:
            warm = any(e.is_file() for e in entries)
    except OSError:
        warm = False
    if not warm:
        return f"compiles first; a second run loads the programs from {cache}"
    return f"programs loaded from the cache in {cache}; shapes not seen before compile first"


def plural(count: int, word: str, many: str | None = None) -> str:
    """`1 trial`, `2 trials` (`many` when the plural is not `word + 's'`)."""
    return f"{count} {word if count == 1 else (many or word + 's')}"


class OneLineErrors(argparse.ArgumentParser):
    """A sub-command's parser whose option errors are one line on stderr (exit status 2),
    `dlbfluid VERB: error: argument --X: ...`, pointing at `--help` rather than printing
    the whole usage block before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def table(rows: list[list], header: list[str]) -> str:
    """A plain aligned text table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_run_options(p: argparse.ArgumentParser, *, horizon: float) -> None:
    """`--step-size`, `--tick` and `--horizon`, shared by the commands that simulate."""
    p.add_argument(
        "--step-size",
        type=positive_float("step-size"),
        default=0.05,
        help="flow-routing step size eta; the update is x <- Proj(x - eta*h*c) (default 0.05)",
    )
    p.add_argument(
        "--tick",
        type=positive_float("tick"),
        default=PROBE_TICK,
        help=f"probe tick period h in seconds: probe, routing-update and decision-hold period "
        f"(default {PROBE_TICK:g}, the paper's probe cadence)",
    )
    p.add_argument(
        "--horizon",
        type=positive_float("horizon"),
        default=horizon,
        help=f"simulated time T in seconds, a multiple of --tick (default {horizon:g})",
    )


def add_process_options(p: argparse.ArgumentParser) -> None:
    """`--coordinator`, `--num-processes`, `--process-id`, `--detect-cluster`: one run
    shared by several processes and hosts (`dlbfluid._runtime.distributed`; docs/cli.md, *On
    a cluster*)."""
    g = p.add_argument_group(
        "across processes and hosts (jax.distributed)",
        "Start the same command once per process with these three options added (or "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set): each process "
        "computes its share of the scenarios; process 0 prints and writes the merged "
        "results, equal to a one-process run's.",
    )
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's host and a free port, the same for every process "
        "(default $JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes", metavar="P", help="number of processes (default $JAX_NUM_PROCESSES)"
    )
    g.add_argument(
        "--process-id",
        metavar="I",
        help="this process, in [0, P) (default $JAX_PROCESS_ID)",
    )
    g.add_argument(
        "--detect-cluster",
        action="store_true",
        help="let JAX's cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU) supply "
        "what is not given",
    )


# Options that may differ between the processes of one run (only process 0 uses them).
_PER_PROCESS = {
    "coordinator",
    "num_processes",
    "process_id",
    "detect_cluster",
    "out",
    "json",
    "no_progress",
}


def start_processes(args):
    """The `Processes` of this run from the options of `add_process_options` (validated
    before any work; `jax.distributed` initialised when there are several), after
    checking that every process runs the same command with the same options."""
    from .._runtime.distributed import start

    procs = start(args.coordinator, args.num_processes, args.process_id, detect=args.detect_cluster)
    if procs.count > 1:
        opts = {k: v for k, v in sorted(vars(args).items()) if k not in _PER_PROCESS}
        mine = json.loads(json.dumps({k: v for k, v in opts.items() if not callable(v)}))
        first, *others = procs.allgather(mine, "options")
        for p, theirs in enumerate(others, 1):
            diff = [k for k in first if theirs.get(k) != first[k]]
            if diff:
                k = diff[0]
                raise ValueError(
                    f"--{k.replace('_', '-')} = {theirs.get(k)!r} on process {p} is invalid: "
                    f"process 0 runs with {first[k]!r}; every process must run the same "
                    "command with the same options"
                )
    return procs
