"""`dlbfluid experiment KIND`: the paper's evaluation (seed App. B) in the fluid model."""

from __future__ import annotations

import sys

from ._common import add_process_options, emit_json, positive_float, table


def register(sub) -> None:
    from .._experiment import KINDS, POLICIES
    from .._registry import POLICIES as REGISTERED

    p = sub.add_parser(
        "experiment",
        help="the paper's evaluation: six DLB policies against Rand and MNLB on generated "
        "scenarios",
        description="Draw App.-B scenarios, simulate every policy on scenarios x trials "
        "(trials differ by arrival-rate fluctuations), and report mean latency normalised by "
        "Rand's (mean and 10/50/90th percentiles across scenarios and trials) and error "
        "rates. Results go to DIR/results.csv as each (variant, policy) batch finishes; a "
        "rerun with the same DIR resumes. DIR also gets summary.csv, summary.json and a plot.",
    )
    p.add_argument("kind", choices=KINDS, help="which experiment")
    p.add_argument("--scenarios", type=int, default=10, help="scenarios per variant (default 10)")
    p.add_argument("--trials", type=int, default=5, help="trials per scenario (default 5)")
    p.add_argument("--seed", type=int, default=0, help="random stream (default 0)")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="output directory (default experiment-KIND)"
    )
    p.add_argument(
        "--horizon",
        type=positive_float("horizon"),
        default=600.0,
        help="simulated seconds (default 600)",
    )
    p.add_argument(
        "--tick",
        type=positive_float("tick"),
        default=0.05,
        help="probe tick in seconds (default 0.05)",
    )
    p.add_argument(
        "--step-fraction",
        type=positive_float("step-fraction"),
        default=0.3,
        help="flow step size as a fraction of each scenario's eta* (default 0.3)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        metavar="POLICY",
        choices=REGISTERED.names(),
        help=f"policies to run (default {', '.join(POLICIES)}; rand is required)",
    )
    p.add_argument(
        "--no-error-aversion",
        action="store_true",
        help="roots do not shift traffic away from failing cells",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    add_process_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from .._experiment import ExperimentConfig, run_experiment

    cfg = ExperimentConfig(
        experiment=args.kind,
        scenarios=args.scenarios,
        trials=args.trials,
        seed=args.seed,
        horizon=args.horizon,
        tick=args.tick,
        step_fraction=args.step_fraction,
        policies=tuple(args.policies),
        error_aversion=not args.no_error_aversion,
    )
    out = args.out or f"experiment-{args.kind}"
    res = run_experiment(
        cfg,
        out,
        progress=not args.no_progress and sys.stderr.isatty(),
        processes=getattr(args, "processes", None),
    )
    if res is None:  # not process 0: it prints and writes the merged results
        return 0
    res["out"] = str(out)
    if args.json:
        emit_json(res)
        return 0
    rows = [
        [
            s["variant"],
            s["policy"],
            _f(s["normalized_latency"]),
            _f(s["normalized_latency_p90"]),
            _f(s["mean_latency"]),
            _f(None if s["error_rate"] is None else 100 * s["error_rate"]),
            s["failed"],
        ]
        for s in res["summary"]
    ]
    print(
        table(
            rows,
            ["variant", "policy", "lat/rand", "p90 lat/rand", "latency (s)", "errors %", "failed"],
        )
    )
    print(f"results in {out}/ (results.csv, summary.csv, summary.json, {args.kind}.png)")
    return 0


def _f(v):
    return "-" if v is None else f"{v:.4g}"
