"""The `dlbfluid` command line: one sub-command per verb.

Each sub-command lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func` (called with the parsed arguments, returning an exit code). The
sub-commands with the options of `_common.add_process_options` run across processes
(`dlbfluid._runtime.distributed`): `main` starts them before the work and passes them on as
`args.processes`.

Parsing (and `--help`) imports no JAX: the sub-command modules import the numerics inside
`func`, and the package loads its public names on first use. Before a command runs, `main`
enables float64 and the persistent compilation cache (`dlbfluid._runtime.cache`).
"""

from __future__ import annotations

import argparse
import sys

from . import _demo, _simulate
from ._common import OneLineErrors

_COMMANDS = [_simulate, _demo]
# The command that takes every core as a CPU device (`dlbfluid.use_cpu_cores`) when it runs
# as one process: `experiment` (1.6x on 2 cores, the same results; benchmarks/HISTORY.md,
# *Every core a device*). `verify` gained 1.1x only (its time is in the equilibrium and
# stability solvers) and its per-device batches round differently in the last bits; the
# others keep one device and their kept traced programs (`dlbfluid._runtime.exported`, one device
# only), which matter more to their latency.
_CORE_COMMANDS = ("experiment",)


def _optional(name: str):
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:  # a sub-command module not present in this build
        if e.name == f"{__name__}.{name}":
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlbfluid",
        description="The DLB fluid model of distributed load balancing for GenAI inference: "
        "delayed routing dynamics, equilibria and convergence diagnostics, in JAX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrors)
    sub.required = True
    mods = list(_COMMANDS)
    for name in ("_equilibrium", "_stability", "_verify", "_experiment"):
        mod = _optional(name)
        if mod is not None:
            mods.append(mod)
    for mod in mods:
        mod.register(sub)
    return parser


def _one_process(args) -> bool:
    from .._runtime.distributed import resolve

    if not hasattr(args, "process_id"):
        return True
    opts = (args.coordinator, args.num_processes, args.process_id)
    return resolve(*opts, detect=args.detect_cluster) is None


def main(argv: list[str] | None = None) -> int:
    from .._errors import ScenarioError
    from ._common import start_processes

    parser = build_parser()
    args = parser.parse_args(argv)
    from .. import enable_x64
    from .._runtime.cache import enable_from_environment
    from .._runtime.exported import exporting

    enable_x64()
    cache = enable_from_environment()
    procs = None
    try:
        from .._runtime.devices import fast_compile

        fast_compile()  # ($DLBFLUID_FAST_COMPILE checked before any work)
        if args.command in _CORE_COMMANDS and _one_process(args):
            from .._runtime.devices import use_cpu_cores

            use_cpu_cores()
        if hasattr(args, "process_id"):  # a command that runs across processes
            procs = args.processes = start_processes(args)
        with exporting(cache):  # traced solvers kept beside the compiled ones (`_runtime.exported`)
            code = int(args.func(args) or 0)
    except ScenarioError as e:
        print(f"dlbfluid {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except ValueError as e:
        print(f"dlbfluid {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except BaseException as e:  # a failure: the other processes stop too, not wait
        if procs is not None:
            procs.abort(f"{type(e).__name__}: {e}")
        raise
    if procs is not None:
        # Every process waits for process 0 and exits with its status.
        code = procs.finish(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
