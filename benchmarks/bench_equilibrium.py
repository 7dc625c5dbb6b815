"""Benchmark: batched equilibria (JAX) against cvxpy + Clarabel one problem at a time.

A batch of random networks (default 1000 networks of 10 cells): softplus and M/M/1 cells,
random one-way latencies, about 15% of the arcs forbidden (residency; every cell keeps its
own arc), demand 50-95% of total capacity, every network strictly feasible. Half of the
networks (even indices) are all-M/M/1, the others mix softplus and M/M/1 cells.

For each cost (rif, latency, gradient) the JAX solver runs once to compile (reported as
`compile_s`), then is timed on the whole batch after `block_until_ready` (best of
`--repeats`). cvxpy cannot express the softplus potentials, so the cvxpy side solves the
first `--cvxpy-problems` all-M/M/1 networks of the same batch, one by one (problem
construction included, as a user would run it), with the closed-form M/M/1 potentials of
theory/equilibria.md §1.2; its throughput is extrapolated per problem. The JSON states this.

Run: `python benchmarks/bench_equilibrium.py [--batch 1000] [--n-cells 10] [--out FILE]`.
Prints one JSON object on stdout and a Markdown table on stderr (timing, table and `--out`
by `_harness.py`).
"""

from __future__ import annotations

import argparse
import sys
import time

import _harness as H
import numpy as np

H.add_tests_to_path()
from cvxpy_reference import cvxpy_solve  # noqa: E402

import dlbfluid as dl  # noqa: E402
from dlbfluid._equilibrium import solve_equilibrium  # noqa: E402

dl.enable_x64()

COSTS = ("rif", "latency", "gradient")


def random_network(rng: np.random.Generator, n: int, mm1_only: bool) -> dict:
    caps = rng.uniform(1.0, 20.0, n)
    cells = []
    for j in range(n):
        if not mm1_only and rng.random() < 0.5:
            L0 = rng.uniform(0.2, 2.0)
            knee = rng.uniform(0.1, 0.9) * L0 * caps[j]
            svc = {
                "model": "softplus",
                "capacity": float(caps[j]),
                "base_latency": float(L0),
                "knee": float(knee),
                "width": float(rng.uniform(0.3, 3.0)),
            }
        else:
            svc = {"model": "mm1", "capacity": float(caps[j])}
        cells.append(
            {
                "name": f"c{j}",
                "replicas": int(rng.integers(1, 9)),
                "service": svc,
                "arrival_rate": 0.0,
            }
        )
    lat = [
        [
            0.0 if i == j else (None if rng.random() < 0.15 else float(rng.uniform(0.0, 0.2)))
            for j in range(n)
        ]
        for i in range(n)
    ]
    lam = rng.uniform(0.5, 0.95) * caps.sum() * rng.dirichlet(np.full(n, 0.7))
    for j in range(n):
        cells[j]["arrival_rate"] = float(lam[j])
    return {"name": "bench", "cells": cells, "latency": lat}


def make_batch(rng, B: int, n: int):
    dicts, scns = [], []
    while len(scns) < B:
        d = random_network(rng, n, mm1_only=len(scns) % 2 == 0)
        try:
            s = dl.scenario_from_dict(d)
        except dl.OverloadError:
            continue
        dicts.append(d)
        scns.append(s)
    return dicts, dl.stack_scenarios(scns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        parents=[H.parent_parser(repeats=5, repeats_help="timed JAX repeats, best kept")],
    )
    ap.add_argument("--batch", type=int, default=1000, help="networks in the batch (1000)")
    ap.add_argument("--n-cells", type=int, default=10, help="cells per network (10)")
    ap.add_argument(
        "--cvxpy-problems",
        type=int,
        default=50,
        help="all-M/M/1 networks timed with cvxpy, per cost (50)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = H.parse(ap, argv)
    if args.batch < 2 or args.n_cells < 2:
        ap.error("--batch and --n-cells must be at least 2")
    # Every core a CPU device: solve_equilibrium shards the batch over this process's
    # devices (nothing changes where XLA_FLAGS already chose, or on an accelerator).
    dl.use_cpu_cores()

    load_before = H.loadavg()
    rng = np.random.default_rng(args.seed)
    t = time.perf_counter()
    dicts, batch = make_batch(rng, args.batch, args.n_cells)
    gen_s = time.perf_counter() - t
    subset = [b for b in range(args.batch) if b % 2 == 0][: args.cvxpy_problems]

    cvxpy_solve(dicts[subset[0]], "gradient")  # cvxpy's first call pays for its imports
    per_cost = {}
    for cost in COSTS:
        timing = H.timed(lambda: solve_equilibrium(batch, cost, check=False), args.repeats)
        sol, wall, cpus = timing.result, timing.wall_s, timing.cpus_s
        kkt = np.asarray(sol.kkt_residual)
        status = np.asarray(sol.status)
        N_jax = np.asarray(sol.N)
        t, c = time.perf_counter(), time.process_time()
        diffs, rel = [], []
        for b in subset:
            N_cvx = cvxpy_solve(dicts[b], cost, tight=False)[1]
            d = np.abs(N_jax[b, : args.n_cells] - N_cvx)
            diffs.append(np.max(d))
            rel.append(np.max(d / (np.abs(N_cvx) + 1e-3 * np.max(np.abs(N_cvx)))))
        cvx_wall = time.perf_counter() - t
        cvx_cpu = time.process_time() - c
        per_cost[cost] = {
            "compile_s": timing.first_minus_best_s,
            "jax_wall_s": wall,
            "jax_problems_per_s": args.batch / wall,
            "jax_worst_kkt": float(kkt.max()),
            "jax_failed": int(np.sum(status != 0)),
            "jax_mean_iterations": float(np.asarray(sol.iterations).mean()),
            "jax_cpu_s": min(cpus),
            "jax_cpu_ms_per_problem": 1e3 * min(cpus) / args.batch,
            "cvxpy_wall_s": cvx_wall,
            "cvxpy_problems_per_s": len(subset) / cvx_wall,
            "cvxpy_cpu_ms_per_problem": 1e3 * cvx_cpu / len(subset),
            "max_abs_N_diff_vs_cvxpy": float(max(diffs)),
            "max_rel_N_diff_vs_cvxpy": float(max(rel)),
        }
        H.log(f"{cost}: done")

    jax_wall = sum(r["jax_wall_s"] for r in per_cost.values())
    cvx_wall = sum(r["cvxpy_wall_s"] for r in per_cost.values())
    jax_rate = len(COSTS) * args.batch / jax_wall
    cvx_rate = len(COSTS) * len(subset) / cvx_wall
    out = {
        **H.environment("devices"),
        "dtype": "float64",
        "batch": args.batch,
        "n_cells": args.n_cells,
        "costs": list(COSTS),
        "compile_s": sum(r["compile_s"] for r in per_cost.values()),
        "jax_wall_s": jax_wall,
        "jax_problems_per_s": jax_rate,
        "jax_worst_kkt": max(r["jax_worst_kkt"] for r in per_cost.values()),
        "jax_failed": sum(r["jax_failed"] for r in per_cost.values()),
        "cvxpy_problems_timed": len(COSTS) * len(subset),
        "cvxpy_problems_per_s": cvx_rate,
        "speedup": jax_rate / cvx_rate,
        "cpu_time_ratio": sum(r["cvxpy_cpu_ms_per_problem"] for r in per_cost.values())
        / sum(r["jax_cpu_ms_per_problem"] for r in per_cost.values()),
        "target": "speedup >= 100 at worst KKT residual <= 1e-9 (issue 3, section 10)",
        "meets_target": bool(
            jax_rate / cvx_rate >= 100.0
            and max(r["jax_worst_kkt"] for r in per_cost.values()) <= 1e-9
        ),
        "max_abs_N_diff_vs_cvxpy": max(r["max_abs_N_diff_vs_cvxpy"] for r in per_cost.values()),
        "max_rel_N_diff_vs_cvxpy": max(r["max_rel_N_diff_vs_cvxpy"] for r in per_cost.values()),
        "notes": (
            "jax: the whole batch (half all-M/M/1, half mixed softplus/M/M/1 networks) for "
            "each of the three costs, timed after a warm-up with block_until_ready, best of "
            f"{args.repeats}; compile_s = first call minus timed call. cvxpy (Clarabel, "
            f"default tolerances): the first {len(subset)} all-M/M/1 networks of the same "
            "batch per cost, one problem at a time including problem construction "
            "(cvxpy cannot express softplus potentials); its rate is extrapolated per "
            "problem. cpu_time_ratio = cvxpy CPU time per problem over JAX CPU time per "
            "problem (all threads), less sensitive to other jobs on the machine than wall time. "
            "The N differences are over that subset; they are Clarabel's accuracy "
            "(default tolerances), amplified near capacity where N = z/(c - z)."
        ),
        "per_cost": per_cost,
        "generation_s": gen_s,
        "load_average_before_after": [(load_before or [None])[0], (H.loadavg() or [None])[0]],
        **H.environment("cpu_count"),
    }
    H.emit(out, args.out, indent=None, out_indent=1)
    header = ("cost", "jax/s", "cvxpy/s", "speedup", "worst KKT", "failed", "max abs dN")
    rows = []
    for c, r in per_cost.items():
        rows.append(
            (
                c,
                f"{r['jax_problems_per_s']:.0f}",
                f"{r['cvxpy_problems_per_s']:.1f}",
                f"{r['jax_problems_per_s'] / r['cvxpy_problems_per_s']:.0f}x",
                f"{r['jax_worst_kkt']:.1e}",
                str(r["jax_failed"]),
                f"{r['max_abs_N_diff_vs_cvxpy']:.1e}",
            )
        )
    H.log(H.markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
