"""The M/M/1 FIFO p90 of the request-level twin at 10^6 requests (issue 32 acceptance).

One `servers` cell of one exponential FIFO server (`simulate_requests(service="servers")`
on an M/M/1 cell), $\\bar\\mu = 10$/s, $\\lambda = 5$/s, no delay: the sojourn time is
$\\mathrm{Exp}(\\bar\\mu - \\lambda)$, so $p_q = -\\ln(1 - q)/(\\bar\\mu - \\lambda)$:
p50 = ln 2/5, p90 = ln 10/5, p99 = ln 100/5. The percentiles are those of the pooled
histogram of all trials (`LatencyHistogram.percentile`, relative resolution 0.90%); the
acceptance asks the p90 within 2%. The spread is from `--groups` disjoint groups of trials
(the standard error of the pooled p90 is their standard deviation over sqrt(groups)).

    PYTHONUNBUFFERED=1 python benchmarks/mm1_p90.py --out benchmarks/results/requests_mm1_p90_cpu.json
"""

from __future__ import annotations

import argparse
import math
import time

import _harness as H
import jax
import jax.numpy as jnp
import numpy as np

import dlbfluid
from dlbfluid import scenario_from_dict, simulate_requests

MU, LAM = 10.0, 5.0


def one_cell() -> dict:
    cell = {"name": "a", "arrival_rate": LAM, "replicas": 1}
    cell["service"] = {"model": "mm1", "capacity": MU}
    return {"name": "mm1", "cells": [cell], "latency": [[0.0]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[H.parent_parser()])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--horizon", type=float, default=205.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = H.parse(ap, argv)
    dlbfluid.enable_x64()
    env = H.environment("cpu_count", "loadavg_start", "jax_version")
    kw = dict(service="servers", trials=args.trials, horizon=args.horizon)
    kw.update(warmup=args.warmup, tick=0.25, n_save=1, seed=args.seed)
    t0 = time.perf_counter()
    sol = jax.block_until_ready(simulate_requests(scenario_from_dict(one_cell()), "rand", **kw))
    wall = time.perf_counter() - t0
    hist = np.asarray(sol.histogram)
    bins = sol.histogram_bins
    theta = MU - LAM
    rows = {}
    for q in (0.5, 0.9, 0.99):
        exact = -math.log(1 - q) / theta
        est = float(bins.percentile(jnp.asarray(hist.sum(0)), q))
        groups = [
            float(bins.percentile(jnp.asarray(g.sum(0)), q))
            for g in np.array_split(hist, args.groups)
        ]
        rows[f"p{int(q * 100)}"] = {
            "estimate_s": est,
            "exact_s": exact,
            "relative_error": est / exact - 1,
            "se_s": float(np.std(groups, ddof=1) / math.sqrt(args.groups)),
        }
    served = int(np.sum(sol.served))
    p90 = rows["p90"]["relative_error"]
    out = {
        "benchmark": "mm1_p90",
        "model": "one exponential FIFO server, mu = 10/s, lambda = 5/s, service='servers'",
        "trials": args.trials,
        "horizon_s": args.horizon,
        "warmup_s": args.warmup,
        "served": served,
        "mean_s": float(np.sum(sol.latency_sum)) / served,
        "mean_exact_s": 1 / theta,
        "percentiles": rows,
        "histogram_resolution": bins.resolution,
        "p90_within_2_percent": abs(p90) < 0.02,
        "statuses": {
            str(k): int(v) for k, v in zip(*np.unique(sol.status_names(), return_counts=True))
        },
        "wall_s_with_compile": wall,
        "environment": env,
        "git": H.git_state(),
    }
    H.log(
        f"{served} served: p90 {rows['p90']['estimate_s']:.5f} s against {rows['p90']['exact_s']:.5f} ({100 * p90:+.3f}%)"
    )
    H.emit(out, args.out)


if __name__ == "__main__":
    main()
