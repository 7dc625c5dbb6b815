"""Pieces shared by the sub-commands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np


def load_scenario_arg(path: str, *, allow_overload: bool = False):
    """A scenario from a path, or the built-in default for the literal name `default`."""
    from .._scenario import default_scenario, load_scenario

    if path == "default":
        return default_scenario()
    return load_scenario(path, allow_overload=allow_overload)


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


def positive_float(name: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a number") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number > 0")
        return v

    parse.__name__ = name
    return parse


def check_out_dir(path: str | None, flag: str = "--out") -> Path | None:
    """Check, before any work, that `path` is (or can be made) a writable directory:
    creates it and returns it, or raises `ValueError` naming `flag`, the value and what is
    allowed (an existing file, an uncreatable or unwritable directory)."""
    import os

    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: it is an existing file; expected a directory "
            "(existing or new)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: the directory cannot be created "
            f"({e.strerror or e}); expected a writable directory"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(
            f"{flag} = {str(path)!r} is invalid: the directory is not writable; "
            "expected a writable directory"
        )
    return out


def check_whole_ticks(horizon: float, tick: float, flag: str = "--horizon") -> int:
    """The number of ticks in `horizon`, or `ValueError` naming `flag` when the horizon is
    not a whole number of ticks (checked before any work)."""
    K = int(round(horizon / tick))
    if K < 1 or abs(K * tick - horizon) > 1e-9 * horizon:
        raise ValueError(
            f"{flag} = {horizon:g} is invalid: expected a whole number (>= 1) of ticks of "
            f"--tick = {tick:g} s"
        )
    return K


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
        default=0.05,
        help="probe tick period h in seconds (default 0.05)",
    )
    p.add_argument(
        "--horizon",
        type=positive_float("horizon"),
        default=horizon,
        help=f"simulated time T in seconds, a multiple of --tick (default {horizon:g})",
    )


def add_process_options(p: argparse.ArgumentParser) -> None:
    """`--coordinator`, `--num-processes`, `--process-id`, `--detect-cluster`: one run
    shared by several processes and hosts (`dlbfluid._distributed`; README, *On a
    cluster*)."""
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
    from .._distributed import start

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
