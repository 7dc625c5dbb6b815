"""Issue #41: the bracketed search for the global threshold eta_g, timed, with the cost of
its adversarial starts.

    python benchmarks/bench_worst_case.py [--scenarios 32] [--starts 16]
        [--horizon 300] [--tick 0.05] [--policy flow-grad] [--out FILE]

Random networks of `dlbfluid verify` (`draw_scenario(seed, i)`, 2-6 cells, padded to 6),
their equilibria and batched critical steps eta* (not timed), then for each starts count
one `global_threshold` call (`WorstCaseSearch`'s defaults: range 0.25-1.1 eta*, coarse
ladder of ratio <= 1.25, bisection to 1%, 2 adversarial starts, witnesses re-run at half
the tick for twice the horizon) on this process's devices (one per core: `use_cpu_cores`
is called first). Compile time apart: a warm-up call with a horizon of 20 ticks compiles
the programs (the horizon is traced, so the timed call reuses them). The adversarial
starts' cost: `_Runs.adversarial` timed alone (warm-up first), against the search without
them (`ascent_steps=0`, the same passes otherwise).

First the symmetric pair at tau = 0.5, searched with `--pair-starts` starts: flow-grad,
flow-lat and flow-rif (the bracket over eta*, the witness's amplitude and period).

The peer, measured in the same run: `dlbfluid.simulate` on one pass's runs (starts x
scenarios) for the same ticks (4 saves), so that the search's loop can be compared with
the simulator it is built from.

Prints one JSON object on stdout (also to `--out`), a summary on stderr. Timing and the
record by `_harness.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import _harness as H
import jax
import numpy as np

import dlbfluid as dl
from dlbfluid._global_threshold import WorstCaseSearch, global_threshold
from dlbfluid._global_threshold.search import _Runs, _starts
from dlbfluid._verify import draw_scenario
from dlbfluid._verify.summary import global_threshold_summary

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
    bracketed with flow-grad, flow-lat and flow-rif (the defaults but `starts`)."""
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
    for policy in ("flow-grad", "flow-lat", "flow-rif"):
        eq = dl.solve_equilibrium(batch, dl.policy_from_name(policy).cost, throw=False, check=False)
        es = float(np.asarray(dl.batch_critical_step_size(batch, policy, eq).critical_step_size)[0])
        t0 = time.perf_counter()
        rec = global_threshold(batch, policy, eq, np.array([es]),
                               config=WorstCaseSearch(starts=starts))[0]  # fmt: skip
        lo, hi = rec["eta_global_bracket"]
        w = rec.pop("witness") or {}
        out[policy] = {
            "eta_star": es,
            "bracket_over_eta_star": [None if v is None else v / es for v in (lo, hi)],
            "amplitude": w.get("amplitude"),
            "period": w.get("period"),
            "wall_s": round(time.perf_counter() - t0, 2),
            **rec,
        }
    return out


def _peer(batch, args, eta_star, S: int, K: int) -> dict:
    """The peer: `dlbfluid.simulate` on one pass's runs (each scenario repeated S times,
    at 0.9 eta*, from the scenario's own initial state: the cost of a tick does not depend
    on the start) for the same ticks, with 4 saves; compile apart (a warm-up of 20 ticks:
    the tick count is data, one compilation serves both)."""
    B = batch.batch_shape[0]
    flat = jax.tree_util.tree_map(lambda a: np.repeat(np.asarray(a)[None], S, 0), batch)
    flat = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), flat)
    step = np.tile(0.9 * np.where(np.isfinite(eta_star), eta_star, 1.0), S).reshape(-1, 1)
    kw = dict(step_size=step, tick=args.tick, n_save=4)
    warm = H.measure(lambda: dl.simulate(flat, args.policy, horizon=20 * args.tick, **kw))
    run = H.measure(lambda: dl.simulate(flat, args.policy, horizon=args.horizon, **kw))
    runs = S * B
    return {
        "starts": S,
        "runs": runs,
        "compile_s": round(warm.wall_s, 2),
        "run_s": round(run.wall_s, 2),
        "us_per_run_tick": round(1e6 * run.wall_s / (runs * K), 4),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[H.parent_parser()])
    ap.add_argument("--scenarios", type=int, default=32)
    ap.add_argument("--starts", type=int, nargs="+", default=[16])
    ap.add_argument("--horizon", type=float, default=300.0)
    ap.add_argument("--tick", type=float, default=0.05)
    ap.add_argument("--policy", default="flow-grad")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair-starts", type=int, default=16)
    args = H.parse(ap, argv)
    pair = _pair(args.pair_starts)
    H.log(json.dumps({"pair": pair}, default=str))

    batch = _batch(args.seed, args.scenarios)
    cost = dl.policy_from_name(args.policy).cost
    eq = dl.solve_equilibrium(batch, cost, throw=False, check=False)
    crit = dl.batch_critical_step_size(batch, args.policy, eq)
    ok = eq.status_names() == "success"
    eta_star = np.where(ok, np.asarray(crit.critical_step_size), np.nan)
    K = int(round(args.horizon / args.tick))

    rows = []
    out = None
    for S in args.starts:
        cfg = WorstCaseSearch(starts=S, horizon=args.horizon, tick=args.tick)
        warm = dataclasses.replace(cfg, horizon=20 * args.tick)
        w = H.measure(lambda: global_threshold(batch, args.policy, eq, eta_star, config=warm))
        c = H.measure(lambda: global_threshold(batch, args.policy, eq, eta_star, config=cfg))
        plain = dataclasses.replace(cfg, ascent_steps=0)
        p = H.measure(lambda: global_threshold(batch, args.policy, eq, eta_star, config=plain))
        runs = _Runs(batch, args.policy, eq, eta_star, None, cfg)
        N0, x0 = _starts(runs.scn, runs.N_star, cfg)
        a = H.measure(lambda: runs.adversarial(N0, x0))
        out = c.result
        steps = [r["eta_global_search"]["steps"] for r in out if r["eta_global_search"]]
        row = {
            "starts": S,
            "adversarial_starts": cfg.ascent_starts,
            "ascent_steps": cfg.ascent_steps,
            "compile_s": round(w.wall_s, 2),
            "run_s": round(c.wall_s, 2),
            "run_without_adversarial_s": round(p.wall_s, 2),
            "ascent_alone_s": round(a.wall_s, 2),
            "steps_per_scenario": {"min": min(steps), "max": max(steps)} if steps else None,
        }
        rows.append(row)
        H.log(json.dumps(row))

    peer = _peer(batch, args, eta_star, args.starts[0] + WorstCaseSearch.ascent_starts, K)
    H.log(json.dumps({"peer": peer}))
    assert out is not None
    thr = [{"eta_star": e if np.isfinite(e) else None, **r} for e, r in zip(eta_star, out)]
    result = {
        "benchmark": "worst_case_search_bracket",
        "policy": args.policy,
        "scenarios": args.scenarios,
        "horizon": args.horizon,
        "tick": args.tick,
        "devices": f"{jax.local_device_count()} x {jax.devices()[0].platform}",
        "machine": platform.processor() or platform.machine(),
        "pair_tau_0.5": pair,
        "timings": rows,
        "peer_simulate": peer,
        f"outcome_at_{args.starts[-1]}_starts": global_threshold_summary(thr),
    }
    return H.emit(result, args.out, indent=1, default=lambda v: None if v is None else str(v))


if __name__ == "__main__":
    main()
