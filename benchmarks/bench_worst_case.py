"""Issue #30 item 5: the worst-case search for the global threshold eta_g, timed.

    python benchmarks/bench_worst_case.py [--scenarios 100] [--starts 16 32 64]
        [--horizon 300] [--tick 0.05] [--rungs-below 4] [--rungs-above 2] [--policy flow-grad]
        [--out FILE]

Random networks of `dlbfluid verify` (`draw_scenario(seed, i)`, 2-6 cells, padded to 6),
their equilibria and batched critical steps eta* (not timed), then for each starts count
one `global_threshold` call: every rung x start x scenario as one vmapped batch on this
process's devices (one per core: `use_cpu_cores` is called first). Compile time apart: a
warm-up call with a horizon of 20 ticks compiles the program (the horizon is traced, so
the timed call reuses it); the timed call is the whole search at `--horizon`.

First the symmetric pair at tau = 0.5, searched with `--pair-starts` starts: flow-grad at
tick 0.05 and 0.01 (eta_g/eta*, the witness, the cycle's amplitude and period, which must
not move with the tick), flow-lat and flow-rif at 0.05.

The peer, measured in the same run: `dlbfluid.simulate` on as many runs as the smallest
starts count makes, for the same ticks (4 saves), so that the search's loop can be
compared with the simulator it is built from.

Prints one JSON object on stdout (the pair; per starts count: runs, run-ticks, compile and run
seconds, microseconds per run-tick; and the search's outcome at the largest count:
bistable fraction, eta_g/eta* quantiles, Hopf directions; also to `--out`), a summary on
stderr. Timing and the record by `_harness.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import _harness as H
import jax
import numpy as np

import dlbfluid as dl
from dlbfluid._global_threshold import WorstCaseSearch, global_threshold
from dlbfluid._verify import draw_scenario

dl.use_cpu_cores()
dl.enable_x64()


def _batch(seed: int, count: int):
    scns = []
    for i in range(count):
        d = draw_scenario(seed, i, n_cells=(2, 6))
        scns.append(
            dl.scenario_from_dict({k: v for k, v in d.items() if k not in ("index", "utilisation")})
        )
    return dl.stack_scenarios(scns, n_cells=6)


def _pair(starts: int) -> dict:
    """The symmetric pair of tests/helpers.py (one source, two M/M/1 cells, tau = 0.5),
    searched with flow-grad at tick 0.05 and 0.01, flow-lat and flow-rif at 0.05 (300 s,
    rungs 0.75-0.95 and 1.05-1.10 eta*)."""
    d = {
        "name": "symmetric-pair",
        "cells": [
            {"name": "origin", "arrival_rate": 1.0, "service": {"model": "mm1", "capacity": 1.0}},
            {"name": "left", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 1.0}},
            {"name": "right", "arrival_rate": 0.0, "service": {"model": "mm1", "capacity": 1.0}},
        ],
        "latency": [[None, 0.5, 0.5], [None, 0.0, None], [None, None, 0.0]],
    }
    batch = dl.stack_scenarios([dl.scenario_from_dict(d)])
    out: dict = {}
    for policy, ticks in (
        ("flow-grad", (0.05, 0.01)),
        ("flow-lat", (0.05,)),
        ("flow-rif", (0.05,)),
    ):
        eq = dl.solve_equilibrium(batch, dl.policy_from_name(policy).cost, throw=False, check=False)
        es = np.asarray(dl.batch_critical_step_size(batch, policy, eq).critical_step_size)
        one: dict = {"eta_star": float(es[0])}
        for tick in ticks:
            cfg = WorstCaseSearch(starts=starts, rungs_below=6, rungs_above=2, tick=tick)
            t0 = time.perf_counter()
            rec = global_threshold(batch, policy, eq, es, config=cfg)[0]
            g = rec["eta_global"]
            rec["eta_global_over_eta_star"] = None if g is None else g / float(es[0])
            rec["wall_s"] = round(time.perf_counter() - t0, 2)
            one[f"tick_{tick}"] = rec
        out[policy] = one
    return out


def _peer(batch, args, eta_star, S: int, rungs: int, K: int) -> dict:
    """The peer: `dlbfluid.simulate` on as many runs (each scenario repeated rungs x S
    times, at the rungs' steps, from the scenario's own initial state: the cost of a tick
    does not depend on the start) for the same ticks, with 4 saves; compile
    apart (a warm-up of 20 ticks: the tick count is data, one compilation serves both)."""
    B = batch.batch_shape[0]
    reps = rungs * S
    flat = jax.tree_util.tree_map(lambda a: np.repeat(np.asarray(a)[None], reps, 0), batch)
    flat = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), flat)
    ladder = (
        np.where(np.isfinite(eta_star), eta_star, 1.0)[None, :]
        * 1.05 ** np.repeat(np.arange(rungs) - args.rungs_below, S)[:, None]
    )
    step = ladder.reshape(-1, 1)
    kw = dict(step_size=step, tick=args.tick, n_save=4)
    warm = H.measure(lambda: dl.simulate(flat, args.policy, horizon=20 * args.tick, **kw))
    run = H.measure(lambda: dl.simulate(flat, args.policy, horizon=args.horizon, **kw))
    runs = reps * B
    return {
        "starts": S,
        "runs": runs,
        "compile_s": round(warm.wall_s, 2),
        "run_s": round(run.wall_s, 2),
        "us_per_run_tick": round(1e6 * run.wall_s / (runs * K), 4),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[H.parent_parser()])
    ap.add_argument("--scenarios", type=int, default=100)
    ap.add_argument("--starts", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--horizon", type=float, default=300.0)
    ap.add_argument("--tick", type=float, default=0.05)
    ap.add_argument("--rungs-below", type=int, default=4)
    ap.add_argument("--rungs-above", type=int, default=2)
    ap.add_argument("--policy", default="flow-grad")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair-starts", type=int, default=16)
    args = H.parse(ap, argv)
    pair = _pair(args.pair_starts)
    H.log(json.dumps({"pair": pair}))

    batch = _batch(args.seed, args.scenarios)
    cost = dl.policy_from_name(args.policy).cost
    eq = dl.solve_equilibrium(batch, cost, throw=False, check=False)
    crit = dl.batch_critical_step_size(batch, args.policy, eq)
    ok = eq.status_names() == "success"
    eta_star = np.where(ok, np.asarray(crit.critical_step_size), np.nan)
    rungs = args.rungs_below + args.rungs_above
    K = int(round(args.horizon / args.tick))

    runs = []
    out = None
    for S in args.starts:
        cfg = WorstCaseSearch(
            starts=S,
            rungs_below=args.rungs_below,
            rungs_above=args.rungs_above,
            horizon=args.horizon,
            tick=args.tick,
        )
        warm = WorstCaseSearch(
            starts=S,
            rungs_below=args.rungs_below,
            rungs_above=args.rungs_above,
            horizon=20 * args.tick,
            tick=args.tick,
        )
        w = H.measure(lambda: global_threshold(batch, args.policy, eq, eta_star, config=warm))
        c = H.measure(lambda: global_threshold(batch, args.policy, eq, eta_star, config=cfg))
        out = c.result
        n_runs = rungs * S * args.scenarios
        row = {
            "starts": S,
            "runs": n_runs,
            "run_ticks": n_runs * K,
            "compile_s": round(w.wall_s, 2),
            "run_s": round(c.wall_s, 2),
            "us_per_run_tick": round(1e6 * c.wall_s / (n_runs * K), 4),
        }
        runs.append(row)
        H.log(json.dumps(row))

    peer = _peer(batch, args, eta_star, args.starts[0], rungs, K)
    H.log(json.dumps({"peer": peer}))

    assert out is not None
    usable = np.isfinite(eta_star) & (eta_star > 0)
    ratio = np.array(
        [
            r["eta_global"] / e if r["eta_global"] is not None else np.nan
            for r, e in zip(out, np.where(usable, eta_star, 1.0))
        ]
    )
    ratio = ratio[usable]
    bist = np.array([bool(r["bistable"]) for r, u in zip(out, usable) if u])
    below = np.array([r["bistable"] and r["eta_global"] is None for r in out])
    hopf = [r["hopf"] for r, u in zip(out, usable) if u]

    def q(v):
        v = v[np.isfinite(v)]
        if v.size == 0:
            return None
        return {k: float(np.quantile(v, p)) for k, p in (("q10", 0.1), ("q50", 0.5), ("q90", 0.9))}

    result = {
        "benchmark": "worst_case_search",
        "policy": args.policy,
        "scenarios": args.scenarios,
        "usable_eta_star": int(usable.sum()),
        "rungs": rungs,
        "ladder_ratio": 1.05,
        "horizon": args.horizon,
        "tick": args.tick,
        "devices": f"{jax.local_device_count()} x {jax.devices()[0].platform}",
        "machine": platform.processor() or platform.machine(),
        "pair_tau_0.5": pair,
        "timings": runs,
        "peer_simulate": peer,
        "scaling_in_starts": {
            f"{a['starts']}->{b['starts']}": round(b["run_s"] / a["run_s"], 2)
            for a, b in zip(runs, runs[1:])
        },
        f"outcome_at_{args.starts[-1]}_starts": {
            "bistable_fraction": float(bist.mean()) if bist.size else None,
            "below_ladder_fraction": float(below[usable].mean()) if usable.any() else None,
            "eta_global_over_eta_star": q(ratio),
            "hopf": {k: hopf.count(k) for k in ("subcritical", "supercritical", None)},
        },
    }
    return H.emit(result, args.out, indent=1, default=lambda v: None if v is None else str(v))


if __name__ == "__main__":
    main()
