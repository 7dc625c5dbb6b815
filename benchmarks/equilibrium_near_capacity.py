"""Robustness check, not a timing: equilibria of random 10-cell networks near capacity.

The networks of `bench_equilibrium.py` (half all-M/M/1, half mixed softplus/M/M/1, 15% of
the arcs forbidden), with the total demand rescaled to a uniform fraction in
[`--load-min`, `--load-max`] of the total capacity. Prints one JSON object: per cost the
number of scenarios whose status is not `success`, their loads and KKT residuals, the
worst KKT residual and the iteration counts.

Run: `python benchmarks/equilibrium_near_capacity.py [--batch 500] [--load-min 0.97]
[--load-max 0.999] [--seed 7] [--out FILE]` (`--out` and the record by `_harness.py`).
"""

from __future__ import annotations

import argparse
import sys

import _harness as H
import numpy as np
from bench_equilibrium import random_network

import dlbfluid as dl
from dlbfluid._equilibrium import solve_equilibrium

dl.enable_x64()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[H.parent_parser()])
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--n-cells", type=int, default=10)
    ap.add_argument("--load-min", type=float, default=0.97)
    ap.add_argument("--load-max", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=7)
    args = H.parse(ap, argv)
    dl.use_cpu_cores()  # every core a CPU device, as bench_equilibrium.py runs
    if not 0.0 < args.load_min <= args.load_max < 1.0:
        ap.error("need 0 < --load-min <= --load-max < 1")
    rng = np.random.default_rng(args.seed)
    scns, loads = [], []
    while len(scns) < args.batch:
        d = random_network(rng, args.n_cells, mm1_only=len(scns) % 2 == 0)
        caps = np.array([c["service"]["capacity"] for c in d["cells"]])
        lam = np.array([c["arrival_rate"] for c in d["cells"]])
        load = rng.uniform(args.load_min, args.load_max)
        lam = lam / lam.sum() * load * caps.sum()
        for j, c in enumerate(d["cells"]):
            c["arrival_rate"] = float(lam[j])
        try:
            scns.append(dl.scenario_from_dict(d))
        except dl.OverloadError:
            continue
        loads.append(load)
    batch = dl.stack_scenarios(scns)
    loads = np.asarray(loads)
    out = {"batch": args.batch, "load_range": [args.load_min, args.load_max], "seed": args.seed}
    for cost in ("rif", "latency", "gradient"):
        sol = solve_equilibrium(batch, cost)
        status = np.asarray(sol.status)
        kkt = np.asarray(sol.kkt_residual)
        it = np.asarray(sol.iterations)
        bad = np.nonzero(status != 0)[0]
        out[cost] = {
            "failed": int(bad.size),
            "failed_index": bad.tolist(),
            "failed_load": loads[bad].round(5).tolist(),
            "failed_all_mm1": [bool(b % 2 == 0) for b in bad],
            "failed_kkt": kkt[bad].tolist(),
            "worst_kkt": float(kkt.max()),
            "max_iterations": int(it.max()),
            "mean_iterations": float(it.mean()),
        }
        H.log(f"{cost}: {bad.size} not converged")
    H.emit(out, args.out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
