"""`dlbfluid demo`: the six DLB policies and weighted random on the built-in scenario."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from ._common import add_run_options, emit_json, table, write_json


def _demo_policies() -> tuple[str, ...]:
    """Every registered policy that needs no precomputed schedule (MNLB's optimiser is the
    exception), in registry order."""
    from .._registry import POLICIES

    return tuple(p for p in POLICIES.names() if p != "mnlb")


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="compare all policies on the built-in heterogeneous 4-cell scenario",
        description="Simulate disc-/flow- x rif/lat/grad and weighted random routing on the "
        "built-in 4-cell scenario (unequal latencies, one residency restriction), print a "
        "table and write a PNG of the trajectories.",
    )
    add_run_options(p, horizon=400.0)
    p.add_argument(
        "--out",
        metavar="DIR",
        default="dlbfluid-out",
        help="directory for demo.png and demo.json (default ./dlbfluid-out)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(func=run)


def _equilibria(scn, costs):
    from .._equilibrium import solve_equilibrium

    return {c: solve_equilibrium(scn, c) for c in costs}


def run(args) -> int:
    from .._plot import plot_trajectories
    from .._policies import policy_from_name
    from .._scenario import default_scenario
    from .._simulate import simulate

    scn = default_scenario()
    t0 = time.perf_counter()
    names = _demo_policies()
    pols = {p: policy_from_name(p) for p in names}
    costs = [c.name for c in dict.fromkeys(p.cost for p in pols.values() if p.cost is not None)]
    if "gradient" not in costs:
        costs.append("gradient")
    eq = _equilibria(scn, costs)
    sols, rows, records = [], [], []
    n = scn.n_cells
    for k, pol in enumerate(names):
        print(f"[{k + 1}/{len(names)}] simulating {pol} ...", file=sys.stderr, flush=True)
        sol = simulate(
            scn,
            pol,
            step_size=args.step_size,
            tick=args.tick,
            horizon=args.horizon,
            n_save=min(400, max(1, int(round(args.horizon / args.tick)))),
            throw=False,
        )
        sols.append(sol)
        lat = float(sol.mean_latency(0.25))
        N_T = np.asarray(sol.N[-1])[:n]
        cost = pols[pol].cost
        if cost is None:
            dist, ref = float(sol.final_change), "previous tick"
        else:
            N_star = np.asarray(eq[cost.name].N)[:n]
            dist, ref = float(np.max(np.abs(N_T - N_star))), f"N* ({cost.name})"
        osc = float(sol.oscillation())
        status = str(sol.status_names())
        records.append(
            {
                "policy": pol,
                "mean_latency": lat,
                "distance": dist,
                "distance_to": ref,
                "oscillation": osc,
                "status": status,
                "final": {"N": N_T.tolist()},
            }
        )
        rows.append([pol, f"{lat:.4f}", f"{dist:.3g}", ref, f"{osc:.3g}", status])
    opt = float(eq["gradient"].mean_latency)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_trajectories(sols, out / "demo.png", title=f"{scn.name}: workloads and routing")
    result = {
        "scenario": scn.name,
        "cells": list(scn.cell_names),
        "step_size": args.step_size,
        "tick": args.tick,
        "horizon": args.horizon,
        "optimal_mean_latency": opt,
        "policies": records,
        "png": str(png),
        "wall_s": wall,
    }
    write_json(out / "demo.json", result)
    if args.json:
        emit_json(result)
        return 0
    print(
        f"dlbfluid demo: scenario {scn.name!r} ({', '.join(scn.cell_names)}), "
        f"eta = {args.step_size}, tick = {args.tick} s, horizon = {args.horizon} s"
    )
    print(
        table(
            rows, ["policy", "mean latency (s)", "|N(T) - ref|_inf", "ref", "oscillation", "status"]
        )
    )
    print(
        f"social optimum mean latency: {opt:.4f} s; latency averaged over the last 25% "
        "of the horizon (Little's law, network round trips included)"
    )
    print(f"wrote {png} and {out / 'demo.json'} ({wall:.1f} s)")
    return 0
