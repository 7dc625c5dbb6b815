"""`dlbfluid simulate SCENARIO --policy P --step-size ETA --tick H --horizon T`."""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from ._common import (
    add_process_options,
    add_run_options,
    check_out_dir,
    check_whole_ticks,
    doing,
    emit_json,
    fraction,
    load_scenario_arg,
    positive_float,
    positive_int,
    step_size_warning,
    warn,
    write_json,
)


def add_integrator_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--integrator",
        choices=["fast", "accurate"],
        default="fast",
        help="fast: fixed-step RK4 with exact arrival integrals (default); "
        "accurate: adaptive diffrax Tsit5 with error control",
    )
    p.add_argument(
        "--substeps",
        type=positive_int("substeps"),
        default=None,
        help="RK4 steps per tick for --integrator fast (default: chosen from the cells' "
        "time scale, one step at millisecond ticks)",
    )
    p.add_argument(
        "--rtol",
        type=positive_float("rtol"),
        default=1e-8,
        help="relative tolerance for --integrator accurate (default 1e-8)",
    )
    p.add_argument(
        "--atol",
        type=positive_float("atol"),
        default=1e-10,
        help="absolute tolerance for --integrator accurate (default 1e-10)",
    )


def make_integrator(args):
    from .._simulate import Accurate, Fast

    if args.integrator == "fast":
        return Fast(substeps=args.substeps)  # (None: chosen per batch, Fast.for_batch)
    return Accurate(rtol=args.rtol, atol=args.atol)


def register(sub) -> None:
    from .._registry import POLICIES

    p = sub.add_parser(
        "simulate",
        help="simulate one routing policy on a scenario file",
        description="Integrate the delayed fluid model (workloads and routing) under one "
        "routing policy. SCENARIO is a JSON scenario file, or 'default' for the built-in "
        "4-cell scenario.",
    )
    p.add_argument("scenario", metavar="SCENARIO", help="scenario JSON file, or 'default'")
    p.add_argument(
        "--policy",
        choices=POLICIES.names(),
        default="flow-grad",
        help="routing policy (default flow-grad)",
    )
    add_run_options(p, horizon=100.0)
    p.add_argument(
        "--window",
        type=fraction("window"),
        default=0.5,
        help="fraction of the horizon, at its end, over which mean latency and "
        "throughput are averaged (default 0.5)",
    )
    p.add_argument(
        "--n-save",
        type=positive_int("n-save"),
        default=200,
        help="number of save intervals of the trajectory (default 200)",
    )
    add_integrator_options(p)
    p.add_argument(
        "--allow-overload",
        action="store_true",
        help="simulate even if demand exceeds what any routing can serve",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument(
        "--out", metavar="DIR", help="write trajectory.npz, summary.json and trajectory.png to DIR"
    )
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    p.add_argument(
        "--no-step-check",
        action="store_true",
        help="skip the comparison of a flow policy's --step-size with its critical step size "
        "eta* (one equilibrium solve and a linear stability test before the run)",
    )
    add_process_options(p)
    p.set_defaults(func=run)


STEP_RATIO_WARN = 1.0
"""`simulate` warns when a flow policy's step size exceeds this multiple of $\\eta^*$."""


def step_check(scn, policy: str, step_size: float, allow_overload: bool) -> dict:
    """The plausibility check of a flow policy's step size (`step_size_ratio`,
    theory/stability.md §3.8): `{"step_size", "critical_step_size", "ratio", "method"}`, or
    `{"ratio": None, "reason": ...}` when there is no equilibrium to linearise around
    (overload under `--allow-overload`) or the test is refused. Only for a flow policy
    (`flow_policy_names`, the policies with a step size)."""
    from .._errors import OverloadError
    from .._stability import step_size_ratio

    try:
        return step_size_ratio(scn, policy, step_size)
    except OverloadError as e:
        if not allow_overload:
            raise
        return {"step_size": step_size, "critical_step_size": None, "ratio": None,
                "method": None, "reason": f"no equilibrium: {e}"}  # fmt: skip
    except RuntimeError as e:
        return {"step_size": step_size, "critical_step_size": None, "ratio": None,
                "method": None, "reason": str(e)}  # fmt: skip


def _latency_text(summary: dict) -> str:
    """The mean latency, or why there is none: no request arrived in the window (zero
    demand), or every one was dropped."""
    lat = summary["mean_latency"]
    if math.isfinite(lat) or summary["status"] != "success":
        return f"{lat:.6g} s"
    err = summary["error_rate"]
    if not math.isfinite(err):
        return "n/a (no arrivals in the window)"
    return "n/a (every arrival in the window was dropped)"


def run(args) -> int:
    """Every option, the scenario and `--out` are checked before the simulation starts
    (exit status 2). With zero demand over the averaging window the mean latency is
    undefined: null in JSON, "n/a (no arrivals in the window)" in the text output."""
    procs = getattr(args, "processes", None)
    if procs is not None and not procs.main:
        return 0  # one scenario: process 0 simulates it, the others wait (`finish`)
    check_whole_ticks(args.horizon, args.tick)
    scn = load_scenario_arg(args.scenario, allow_overload=args.allow_overload, command="simulate")
    out = check_out_dir(args.out)
    from .._registry import flow_policy_names
    from .._simulate import simulate

    flow = args.policy in flow_policy_names()  # (the policies with a step size)
    note = step_size_warning(args.step_size, args.tick)
    if note and flow:
        warn("simulate", note)
    n_save = min(args.n_save, max(1, int(round(args.horizon / args.tick))))
    ticks = args.horizon / args.tick
    show = not args.no_progress and (sys.stderr.isatty() or ticks > 20000)
    check = None
    if not args.no_step_check and flow:
        doing("simulate", f"comparing --step-size with {args.policy}'s critical step size")
        check = step_check(scn, args.policy, args.step_size, args.allow_overload)
        if check["ratio"] is not None and check["ratio"] > STEP_RATIO_WARN:
            warn(
                "simulate",
                f"--step-size = {args.step_size:g} is {check['ratio']:.3g} times the critical "
                f"step size eta* = {check['critical_step_size']:.3g} of the linearised model "
                "(dlbfluid stability): expect oscillation, not convergence",
            )
    doing("simulate", f"simulating {args.policy} for {int(round(ticks))} ticks of {args.tick:g} s")
    t0 = time.perf_counter()
    sol = simulate(
        scn,
        args.policy,
        step_size=args.step_size,
        tick=args.tick,
        horizon=args.horizon,
        n_save=n_save,
        integrator=make_integrator(args),
        progress=show,
        throw=False,
    )
    wall = time.perf_counter() - t0
    summary = sol.summary(args.window)
    summary["scenario"] = scn.name
    summary["step_size"] = args.step_size
    summary["step_size_check"] = check
    summary["wall_s"] = wall
    if out is not None:
        np.savez(out / "trajectory.npz", **sol.to_numpy())
        write_json(out / "summary.json", summary)
        from .._plot import plot_trajectories

        plot_trajectories(
            sol, out / "trajectory.png", title=f"{scn.name}: {args.policy}", window=args.window
        )
    if args.json:
        emit_json(summary)
    else:
        n = len(summary["final"]["N"])
        names = summary["cells"] or [f"cell{j}" for j in range(n)]
        print(
            f"scenario {scn.name!r}, policy {args.policy}, eta {args.step_size}, "
            f"tick {args.tick} s, horizon {summary['horizon']} s, status {summary['status']}"
        )
        print(f"mean end-to-end latency (last {args.window:.0%}): {_latency_text(summary)}")
        for j in range(n):
            print(
                f"  {names[j]:>14}: N(T) = {summary['final']['N'][j]:10.5g}   "
                f"throughput = {summary['throughput'][j]:10.5g} req/s"
            )
        print(
            f"change over the last tick: {summary['final_change']:.3g}; "
            f"oscillation (last 25%): {summary['oscillation']:.3g}"
        )
        if args.out:
            print(f"wrote {args.out}/trajectory.npz, summary.json, trajectory.png")
    return 0 if summary["status"] == "success" else 1
