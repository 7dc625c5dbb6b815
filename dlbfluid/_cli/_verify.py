"""`dlbfluid verify --scenarios N --seed S`: batch-verify Theorem 1 on random scenarios."""

from __future__ import annotations

import sys

from .._defaults import PROBE_TICK
from ._common import (
    add_process_options,
    check_min_max,
    check_out_dir_on_main,
    check_whole_ticks,
    emit_json,
    int_in,
    positive_float,
    positive_int,
    seed_int,
    table,
)


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="batch-verify flow-routing convergence (Theorem 1) on random scenarios",
        description="Draw random scenarios satisfying Assumptions 1-3, solve their RIF, "
        "Wardrop and social-optimum equilibria, simulate flow-rif, flow-lat and flow-grad at "
        "a fraction of each scenario's critical step size, and report per scenario: "
        "converged or not, time-average distance, final distance to equilibrium, eta/eta*. "
        "With --out, results are appended to DIR/results.jsonl as they are computed and a "
        "rerun with the same DIR resumes where a killed run stopped.",
    )
    p.add_argument(
        "--scenarios",
        type=positive_int("scenarios"),
        default=64,
        help="number of scenarios (default 64)",
    )
    p.add_argument(
        "--seed", type=seed_int(), default=0, help="random stream, in [0, 2**63) (default 0)"
    )
    p.add_argument(
        "--chunk",
        type=positive_int("chunk"),
        default=32,
        help="scenarios per compiled batch and per write (default 32)",
    )
    p.add_argument(
        "--min-cells", type=int_in("min-cells", 2), default=2, help="fewest cells (default 2)"
    )
    p.add_argument(
        "--max-cells", type=int_in("max-cells", 2), default=6, help="most cells (default 6)"
    )
    p.add_argument(
        "--horizon",
        type=positive_float("horizon"),
        default=200.0,
        help="simulated seconds per scenario (default 200)",
    )
    p.add_argument(
        "--tick",
        type=positive_float("tick"),
        default=PROBE_TICK,
        help=f"probe tick h in seconds (default {PROBE_TICK:g}, the paper's probe cadence)",
    )
    p.add_argument(
        "--step-fraction",
        type=positive_float("step-fraction"),
        default=0.3,
        help="step size as a fraction of the critical eta* (default 0.3)",
    )
    p.add_argument(
        "--conv-tol",
        type=positive_float("conv-tol"),
        default=1e-3,
        help="converged when max|N(T) - N*| <= tol * max(1, max N*) (default 1e-3)",
    )
    p.add_argument("--out", metavar="DIR", help="write results.jsonl and summary.json; resume")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    add_process_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from .._verify import verify

    check_min_max(args.min_cells, args.max_cells, "--min-cells", "--max-cells")
    check_whole_ticks(args.horizon, args.tick)
    check_out_dir_on_main(args, args.out)
    res = verify(
        args.scenarios,
        args.seed,
        out_dir=args.out,
        chunk=args.chunk,
        n_cells=(args.min_cells, args.max_cells),
        horizon=args.horizon,
        tick=args.tick,
        step_fraction=args.step_fraction,
        conv_tol=args.conv_tol,
        progress=not args.no_progress,
        processes=getattr(args, "processes", None),
    )
    if res is None:  # not process 0: it prints and writes the merged results
        return 0
    records = res.pop("records")
    if args.json:
        emit_json({"summary": res, "scenarios": records})
        return 0
    rows = []
    for pol, s in res["policies"].items():
        q = lambda d: (
            "-" if d["q50"] is None else f"{d['q50']:.3g} [{d['q10']:.2g}, {d['q90']:.2g}]"
        )
        rows.append(
            [
                pol,
                f"{s['converged_fraction']:.3f}",
                s["failed"],
                q(s["time_average_distance"]),
                q(s["final_distance"]),
                q(s["eta_over_eta_star"]),
            ]
        )
    print(
        f"{res['scenarios']} scenarios, seed {args.seed}, horizon {args.horizon} s, "
        f"tick {args.tick} s, eta = {args.step_fraction} eta*; devices {res['devices']}"
    )
    print(
        table(
            rows,
            [
                "policy",
                "converged",
                "failed",
                "time-avg distance q50 [q10, q90]",
                "final distance q50 [q10, q90]",
                "eta/eta* q50",
            ],
        )
    )
    print(f"{res['wall_s']:.1f} s", file=sys.stderr)
    return 0
