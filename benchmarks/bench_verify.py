"""Scenarios verified per second by `verify` (Theorem-1 batch verification).

    python benchmarks/bench_verify.py [--sizes 100 1000 10000] [--chunk 256] [--budget-s 900]
                                      [--ladder none|full] [--out FILE]

Each size runs the whole pipeline (equilibria for three costs, the chunk's critical step
sizes in one call, three flow-policy simulations with per-tick saves, the drift
Theorem-1 checks and projection checks; with `--ladder full` also the Theorem-1 ladder) in memory. The first,
smallest run also pays for compilation; it is reported separately by timing a warm-up
chunk first. The former per-scenario pipeline is timed against this one in
`bench_theorem1.py`; the simulate and equilibrium benchmarks measure the pieces against
scipy and cvxpy. Prints one JSON object on stdout (and to `--out`, by `_harness.py`).
"""

from __future__ import annotations

import argparse
import sys
import time

import _harness as H

import dlbfluid
from dlbfluid._verify import verify

dlbfluid.enable_x64()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        parents=[H.parent_parser()],
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--horizon", type=float, default=100.0)
    p.add_argument("--tick", type=float, default=0.05)
    p.add_argument("--ladder", choices=("none", "full"), default="none")
    p.add_argument(
        "--budget-s",
        type=float,
        default=900.0,
        help="skip a size whose estimated time exceeds this (default 900)",
    )
    args = H.parse(p, argv)
    kw = dict(chunk=args.chunk, n_cells=(2, 6), horizon=args.horizon, tick=args.tick,
              ladder=args.ladder)  # fmt: skip
    warm = H.measure(lambda: verify(args.chunk, 12345, **kw)).wall_s  # compiles every piece
    steady_chunk = H.measure(lambda: verify(args.chunk, 54321, **kw)).wall_s
    compile_s = warm - steady_chunk
    results = []
    for n in args.sizes:
        est = steady_chunk * -(-n // args.chunk)
        if est > args.budget_s:
            results.append({"scenarios": n, "skipped": True, "estimated_s": est})
            H.log(f"{n:>6} scenarios: skipped (estimated {est:.0f} s)")
            continue
        t0 = time.perf_counter()
        res = verify(n, 1, **kw)
        wall = time.perf_counter() - t0
        conv = {pol: s["converged_fraction"] for pol, s in res["policies"].items()}
        cert = {pol: s["projection_check_holds_fraction"] for pol, s in res["policies"].items()}
        thm = {pol: s["in_hypothesis_fraction"] for pol, s in res["policies"].items()}
        results.append(
            {
                "scenarios": n,
                "wall_s": wall,
                "scenarios_per_s": n / wall,
                "converged_fraction": conv,
                "projection_check_holds_fraction": cert,
                "in_hypothesis_fraction": thm,
            }
        )
        H.log(f"{n:>6} scenarios: {wall:8.1f} s  {n / wall:8.2f} scenarios/s  converged {conv}")
    H.emit({
        "benchmark": "verify",
        **H.environment("devices", "backend"),
        "dtype": "float64",
        "chunk": args.chunk,
        "horizon": args.horizon,
        "tick": args.tick,
        "ladder": args.ladder,
        "compile_s": compile_s,
        "results": results,
    }, args.out, indent=None)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
