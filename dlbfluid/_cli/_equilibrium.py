"""`dlbfluid equilibrium SCENARIO --cost {rif,latency,gradient,all} [--json]`."""

from __future__ import annotations

import argparse
import math

import numpy as np

from ._common import (
    doing,
    emit_json,
    load_scenario_arg,
    nonneg_float,
    positive_float,
    positive_int,
    table,
)


def _costs() -> tuple[str, ...]:
    from .._registry import COSTS

    return COSTS.names()


def register(sub) -> None:
    p = sub.add_parser(
        "equilibrium",
        help="solve the RIF, Wardrop (latency) and social-optimum (gradient) equilibria",
        description="Solve the convex program whose minimiser is the equilibrium of a cost "
        "family (theory/equilibria.md): rif = equal RIF per replica, latency = Wardrop "
        "equilibrium, gradient = social optimum (minimum mean latency). Prints the "
        "workloads, routing, multipliers, mean latency and KKT certificate of each, and "
        "the price of anarchy when all three are solved. SCENARIO is a JSON scenario "
        "file, or 'default' for the built-in 4-cell scenario. Demand that no routing can "
        "serve within capacity is an error. Without demand at --time, the mean latency and "
        "the price of anarchy are undefined (null in JSON).",
    )
    p.add_argument("scenario", metavar="SCENARIO", help="scenario JSON file, or 'default'")
    p.add_argument(
        "--cost",
        choices=[*_costs(), "all"],
        default="all",
        help="cost family to solve (default all: every registered cost, plus the price of "
        "anarchy of each against the social optimum)",
    )
    p.add_argument(
        "--tol",
        type=positive_float("tol"),
        default=1e-10,
        help="KKT residual below which an equilibrium counts as solved (default 1e-10)",
    )
    p.add_argument(
        "--max-iters",
        type=positive_int("max-iters"),
        default=200,
        help="interior-point iteration cap (default 200)",
    )
    p.add_argument(
        "--time",
        type=nonneg_float("time"),
        default=0.0,
        help="time t >= 0 in seconds at which the arrival-rate profiles are evaluated (default 0)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.set_defaults(func=run)


def _fmt(v: float, digits: int = 6) -> str:
    if math.isnan(v):
        return "n/a"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def run(args: argparse.Namespace) -> int:
    """Solve and print. Zero demand at `--time` (every arrival rate 0) is not an error:
    every routing then has social cost 0, so the equilibria are N = 0 and the mean latency
    and the price of anarchy (a ratio of two zero costs) are undefined: null in JSON,
    "n/a" / "undefined" in the text output."""
    from .._equilibrium import solve_equilibrium

    scn = load_scenario_arg(args.scenario, command="equilibrium")
    costs = _costs() if args.cost == "all" else (args.cost,)
    doing("equilibrium", f"solving the {', '.join(costs)} equilibria of {scn.n_cells} cells")
    sols = {
        c: solve_equilibrium(
            scn, c, tol=args.tol, max_iters=args.max_iters, time=args.time, throw=False
        )
        for c in costs
    }
    at, ar = np.asarray(scn.arrival_times), np.asarray(scn.arrival_rates)
    demand = sum(float(np.interp(args.time, at[i], ar[i])) for i in range(len(at)))
    latency = {c: float(sols[c].mean_latency) if demand > 0 else math.nan for c in costs}
    out = _result(scn, sols, latency)
    if args.cost == "all":
        out.update(_anarchy(scn, sols, demand, args.time))
    ok = all(int(s.status) == 0 for s in sols.values())
    if args.json:
        emit_json(out)
        return 0 if ok else 1
    _print_text(scn, sols, latency, out, demand, args.time)
    if not ok:
        print("warning: some equilibria did not reach the KKT tolerance (status above)")
    return 0 if ok else 1


def _result(scn, sols: dict, latency: dict) -> dict:
    """The JSON object's scenario and each equilibrium's `summary()`, its mean latency
    `latency` (NaN without demand: null in JSON)."""
    records = []
    for c, sol in sols.items():
        rec = sol.summary()
        rec["mean_latency"] = latency[c]  # (no requests: no mean latency, null in JSON)
        records.append(rec)
    return {"scenario": scn.name, "cells": list(scn.cell_names), "equilibria": records}


def _anarchy(scn, sols: dict, demand: float, time: float) -> dict:
    """With every cost solved: each cost's price of anarchy against the social optimum,
    and the range of the mean latency and of the price of anarchy over RIF's equilibria
    (null where undefined: no demand, or an optimum that costs 0)."""
    from .._equilibrium import rif_latency_range

    opt = float(sols["gradient"].social_cost)
    out: dict = {
        "price_of_anarchy": {
            c: (float(sol.social_cost) / opt if demand > 0 and opt != 0 else None)
            for c, sol in sols.items()
            if c != "gradient"
        }
    }
    # RIF's routing is not unique: the range over its equilibria (theory/equilibria.md
    # §5.1), which the solver's routing (the "rif" ratio above) lies in
    out["rif_mean_latency_range"] = out["rif_price_of_anarchy_range"] = None
    if demand > 0:  # (without demand every routing costs 0: nothing to bound)
        doing("equilibrium", "bounding the mean latency over the RIF equilibria (two LPs)")
        rr = rif_latency_range(scn, equilibrium=sols["rif"], time=time)
        lo, hi = float(rr.social_cost_low), float(rr.social_cost_high)
        out["rif_mean_latency_range"] = [
            float(rr.mean_latency_low),
            float(rr.mean_latency_high),
        ]
        if opt != 0:
            out["rif_price_of_anarchy_range"] = [lo / opt, hi / opt]
    return out


def _print_text(scn, sols: dict, latency: dict, out: dict, demand: float, time: float) -> None:
    """The equilibria's table, the cells' workloads and routing, and the price of anarchy."""
    from .._results import RESULTS

    costs = list(sols)
    names = list(scn.cell_names) or [f"cell{j}" for j in range(scn.n_cells)]
    print(f"scenario {scn.name!r}: {len(names)} cells")
    rows = [
        [
            c,
            RESULTS.name(int(sols[c].status)),
            _fmt(latency[c]),
            _fmt(float(sols[c].social_cost)),
            f"{float(sols[c].kkt_residual):.1e}",
            int(sols[c].iterations),
        ]
        for c in costs
    ]
    print(table(rows, ["cost", "status", "mean latency", "social cost", "KKT", "iterations"]))
    print()
    header = ["cell"] + [f"N ({c})" for c in costs] + [f"z ({c})" for c in costs]
    rows = [
        [name]
        + [_fmt(float(np.asarray(sols[c].N)[j])) for c in costs]
        + [_fmt(float(np.asarray(sols[c].z)[j])) for c in costs]
        for j, name in enumerate(names)
    ]
    print(table(rows, header))
    if not demand > 0:
        print()
        print(
            f"no demand at t = {time:g} s (every arrival rate is 0): every routing costs "
            "0, so the mean latency is undefined"
        )
    if "price_of_anarchy" in out:
        _print_anarchy(out)


def _print_anarchy(out: dict) -> None:
    poa = out["price_of_anarchy"]
    print()
    if any(v is None for v in poa.values()):
        print("price of anarchy: undefined (the social optimum costs 0)")
        return
    print(
        "price of anarchy: "
        + ", ".join(f"{c} {v:.6f}" for c, v in poa.items())
        + " (social cost over the social optimum's)"
    )
    rl, rp = out["rif_mean_latency_range"], out["rif_price_of_anarchy_range"]
    print(
        f"over all RIF equilibria (same N*, other routings): mean latency "
        f"{rl[0]:.6g} to {rl[1]:.6g} s, price of anarchy {rp[0]:.6f} to {rp[1]:.6f}"
    )
