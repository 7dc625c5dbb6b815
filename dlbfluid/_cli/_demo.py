"""`dlbfluid demo`: the six DLB policies, weighted random and MNLB on the built-in
scenario."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from .._defaults import SIMULATE_HORIZON
from ._common import (
    add_run_options,
    check_out_dir,
    check_whole_ticks,
    emit_json,
    plural,
    step_size_warning,
    table,
    warn,
    write_json,
)

# MNLB's optimiser settings: those of the experiments' default (`ExperimentConfig`).
MNLB_UPDATE_PERIOD = 10.0
MNLB_UTILISATION_CAP = 0.9
_WINDOW = 0.25  # the fraction of the horizon, at its end, of the reported mean latency
_MAX_SAVES = 400


def _demo_policies() -> tuple[str, ...]:
    """Every registered policy, in registry order."""
    from .._registry import POLICIES

    return POLICIES.names()


def _make_policy(name: str):
    from .._policies import MNLB, policy_from_name

    pol = policy_from_name(name)
    if isinstance(pol, MNLB):
        pol = MNLB(update_period=MNLB_UPDATE_PERIOD, utilisation_cap=MNLB_UTILISATION_CAP)
    return pol


def _plot_order(names) -> tuple[list[str], int]:
    """The panels' order and columns: discrete routing and weighted random on one row,
    flow routing and MNLB on the next (so a column is a cost), then anything else."""
    disc = [p for p in names if p.startswith("disc-")] + [p for p in names if p == "rand"]
    flow = [p for p in names if p.startswith("flow-")] + [p for p in names if p == "mnlb"]
    rest = [p for p in names if p not in disc and p not in flow]
    order = disc + flow + rest
    return order, max(len(disc), len(flow), 1)


def register(sub) -> None:
    from .._registry import POLICIES

    p = sub.add_parser(
        "demo",
        help="compare all policies on the built-in heterogeneous 4-cell scenario",
        description="Simulate disc-/flow- x rif/lat/grad, weighted random and MNLB routing "
        "on the built-in 4-cell scenario (unequal latencies, one residency restriction), "
        "print a table and write a PNG of the trajectories with each policy's mean latency "
        "and equilibrium. Most of its first run goes to compiling one program per policy "
        "and per cost (later runs load them from the compilation cache).",
    )
    add_run_options(p, horizon=SIMULATE_HORIZON)
    p.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        choices=POLICIES.names(),
        default=None,
        help="policies to show (default: all registered, " + ", ".join(POLICIES.names()) + ")",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="dlbfluid-out",
        help="directory for demo.png and demo.json (default ./dlbfluid-out)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(func=run)


def _check_args(args) -> tuple[tuple[str, ...], int, Path]:
    """Every check that can fail, before any work: `(policies, ticks, out directory)`."""
    names = _demo_policies() if args.policies is None else tuple(args.policies)
    dup = sorted({p for p in names if names.count(p) > 1})
    if dup:
        raise ValueError(
            f"--policies = {list(names)} is invalid: {dup} named twice; expected each once"
        )
    K = check_whole_ticks(args.horizon, args.tick)
    out = check_out_dir(args.out)
    assert out is not None
    for name in ("demo.png", "demo.json"):
        if (out / name).is_dir():
            raise ValueError(
                f"--out = {str(args.out)!r} is invalid: {out / name} is a directory; expected "
                "a directory where demo.png and demo.json can be written"
            )
    return names, K, out


def run(args) -> int:
    """Check every option, solve the equilibria of the policies' costs, simulate each
    policy, then write `demo.png` and `demo.json` and print the table (or the JSON)."""
    from .._scenario import default_scenario

    names, K, out = _check_args(args)
    note = step_size_warning(args.step_size, args.tick)
    if note:
        warn("demo", note)
    scn = default_scenario()
    pols = {p: _make_policy(p) for p in names}
    t0 = time.perf_counter()
    eq, sols = _solve_and_simulate(scn, pols, args, min(_MAX_SAVES, K), K)
    records, rows = _policy_records(scn, pols, eq, sols)
    opt = float(eq["gradient"].mean_latency)
    wall = time.perf_counter() - t0
    png = _plot(scn, pols, eq, sols, opt, out)
    result = _result(scn, args, eq, records, opt, str(png), wall)
    write_json(out / "demo.json", result)
    if args.json:
        emit_json(result)
        return 0
    _print_text(scn, args, rows, opt, pols, sols)
    print(f"wrote {png} and {out / 'demo.json'} ({wall:.1f} s)")
    return 0


def _solve_and_simulate(scn, pols: dict, args, n_save: int, K: int) -> tuple[dict, dict]:
    """`(equilibrium per cost, solution per policy)`: the equilibria of the policies'
    costs and the social optimum's (`gradient`), then one run per policy, each step
    announced on stderr."""
    from .._equilibrium import solve_equilibrium
    from .._simulate import simulate

    names = list(pols)
    costs = [c.name for c in dict.fromkeys(p.cost for p in pols.values() if p.cost is not None)]
    if "gradient" not in costs:
        costs.append("gradient")
    # Nearly all of a first run is compiling one program per cost and per policy (each
    # then runs in about a second). Policies cannot share a program: a policy is static
    # in the simulator's trace. XLA compiles outside the GIL, but threads overlapping the
    # compiles measured no faster on two cores, so the steps run in turn.
    steps = [("equilibrium", c) for c in costs] + [("simulate", p) for p in names]
    print(
        f"dlbfluid demo: {plural(len(costs), 'equilibrium', 'equilibria')}, then "
        f"{plural(len(names), 'policy', 'policies')} for {plural(K, 'tick')} "
        "each; a first run spends most of its time compiling",
        file=sys.stderr,
        flush=True,
    )
    eq, sols = {}, {}
    for k, (kind, name) in enumerate(steps, 1):
        what = f"solving the {name} equilibrium" if kind == "equilibrium" else f"simulating {name}"
        print(f"[{k}/{len(steps)}] {what} ...", file=sys.stderr, flush=True)
        if kind == "equilibrium":
            eq[name] = solve_equilibrium(scn, name)
        else:
            sols[name] = simulate(
                scn,
                pols[name],
                step_size=args.step_size,
                tick=args.tick,
                horizon=args.horizon,
                n_save=n_save,
                throw=False,
            )
    return eq, sols


def _policy_records(scn, pols: dict, eq: dict, sols: dict) -> tuple[list[dict], list[list]]:
    """`(JSON record, table row)` of each policy: its mean latency over the window, its
    final distance to its cost's equilibrium (to the previous tick without a cost), its
    oscillation and status."""
    n = scn.n_cells
    rows, records = [], []
    for pol, sol in sols.items():
        lat = float(sol.mean_latency(_WINDOW))
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
                "cost": None if cost is None else cost.name,
            }
        )
        rows.append([pol, f"{lat:.4f}", f"{dist:.3g}", ref, f"{osc:.3g}", status])
    return records, rows


def _plot(scn, pols: dict, eq: dict, sols: dict, opt: float, out: Path):
    """`demo.png`: each policy's trajectories beside its cost's equilibrium; its path."""
    from .._plot import plot_trajectories

    names = list(pols)
    order, ncols = _plot_order(names)
    return plot_trajectories(
        [sols[p] for p in order],
        out / "demo.png",
        title=f"{scn.name}: workloads and routing of {len(names)} "
        f"polic{'ies' if len(names) > 1 else 'y'} "
        f"(social optimum: mean latency {opt:.3f} s)",
        equilibria=[None if pols[p].cost is None else eq[pols[p].cost.name] for p in order],
        window=_WINDOW,
        ncols=ncols,
    )


def _result(scn, args, eq: dict, records: list, opt: float, png: str, wall: float) -> dict:
    """The JSON object of `--json` and `demo.json` (docs/cli.md, *dlbfluid demo*)."""
    n = scn.n_cells
    return {
        "scenario": scn.name,
        "cells": list(scn.cell_names),
        "step_size": args.step_size,
        "tick": args.tick,
        "horizon": args.horizon,
        "optimal_mean_latency": opt,
        "policies": records,
        "png": png,
        "wall_s": wall,
        "latency_window": _WINDOW,
        "equilibria": {
            c: {
                "N": np.asarray(e.N)[:n].tolist(),
                "z": np.asarray(e.z)[:n].tolist(),
                "mean_latency": float(e.mean_latency),
                "status": str(e.status_names()),
            }
            for c, e in eq.items()
        },
        "mnlb": {"update_period": MNLB_UPDATE_PERIOD, "utilisation_cap": MNLB_UTILISATION_CAP},
    }


def _print_text(scn, args, rows: list, opt: float, pols: dict, sols: dict) -> None:
    """The run's line, the policies' table and the notes under it."""
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
        f"social optimum mean latency: {opt:.4f} s; latency averaged over the last "
        f"{_WINDOW:.0%} of the horizon (Little's law, network round trips included)"
        + (
            f"; mnlb re-optimises every {MNLB_UPDATE_PERIOD:g} s under a utilisation cap of "
            f"{MNLB_UTILISATION_CAP:g}"
            if "mnlb" in pols
            else ""
        )
    )
    if "mnlb" in sols:
        print(_mnlb_note(scn, sols["mnlb"], args.horizon))


def _mnlb_note(scn, sol, horizon: float) -> str:
    """Why MNLB can trail Rand here: it minimises network latency alone, under its cap.

    MNLB uses no latency model: its linear program (`dlbfluid._policies.mnlb_weights`) moves traffic only
    to keep each cell under the cap. The cells' utilisation $z_j/\\bar\\mu_j$ at the end
    of the run, with $z_j = \\sum_i \\lambda_i(T) x_{ij}(T)$, and the share of traffic
    served where it arrives say where its latency comes from.
    """
    n = scn.n_cells
    lam = np.array(
        [
            np.interp(horizon, t, r)
            for t, r in zip(np.asarray(scn.arrival_times)[:n], np.asarray(scn.arrival_rates)[:n])
        ]
    )
    x = np.asarray(sol.x[-1])[:n, :n]
    z = lam @ x
    util = z / np.asarray(scn.service.capacity)[:n]
    local = float(np.sum(lam * np.diag(x)) / np.sum(lam))
    return (
        f"mnlb minimises network latency alone (no latency model), only keeping each cell "
        f"under {MNLB_UTILISATION_CAP:g} of its capacity: here it serves {local:.0%} of the "
        f"traffic where it arrives and runs the cells at utilisation "
        f"{', '.join(f'{u:.2f}' for u in util)}, so queueing, not the network, sets its "
        "latency; its 0.943 x rand in the recorded results is the mean over the paper's "
        "generated networks (docs/results.md)"
    )
