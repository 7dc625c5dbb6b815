"""`dlbfluid verify --scenarios N --seed S`: batch-verify Theorem 1 on random scenarios.

Per scenario and flow policy: the integrated drift certificate of one run, and with
`--ladder full` the bound's constants, the T^-1/2 schedule, G1 against the delays and the
empirical eta0 (theory/lyapunov.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from .._defaults import PROBE_TICK, STEP_RULES, VERIFY_GENERATORS, VERIFY_LADDERS
from ._common import (
    add_process_options,
    check_min_max,
    check_out_dir_on_main,
    check_whole_ticks,
    emit_json,
    int_in,
    load_scenario_arg,
    positive_float,
    positive_int,
    seed_int,
    table,
)


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="batch-verify flow-routing convergence (Theorem 1) on random scenarios",
        description="Draw random scenarios satisfying Assumptions 1-3 (or App.-B ones, or take "
        "one scenario file), solve their RIF, Wardrop and social-optimum equilibria, compute "
        "each flow policy's critical step size eta* for a whole chunk at once, simulate "
        "flow-rif, flow-lat and flow-grad, and report per scenario: the integrated drift "
        "certificate of Theorem 1 (holds or not, each term), with --ladder full the bound's "
        "constants A, B, C fitted with the right signs, the T^-1/2 schedule's slope, G1 "
        "against the delay scale and the empirical eta0/eta*; and converged or not, "
        "time-average distance, final distance to equilibrium, eta/eta*. With --out, "
        "results are appended to DIR/results.jsonl as they are computed and a rerun with the "
        "same DIR resumes where a killed run stopped.",
    )
    p.add_argument(
        "--scenarios",
        type=positive_int("scenarios"),
        default=None,
        help="number of scenarios (default 64; 1 with --scenario)",
    )
    p.add_argument(
        "--generator",
        choices=VERIFY_GENERATORS,
        default="random",
        help="scenario source: random = the 2-6-cell networks of theory/lyapunov.md, appb = "
        "the paper's App.-B generator (constant demand, unbounded queues) (default random)",
    )
    p.add_argument(
        "--scenario",
        metavar="FILE",
        help="verify this one scenario file instead of generated ones",
    )
    p.add_argument(
        "--policy",
        default="all",
        help="one flow policy, or all (default all)",
    )
    p.add_argument(
        "--step-rule",
        choices=STEP_RULES,
        default="oracle",
        help="flow step sizes: oracle = --step-fraction x each scenario's critical eta*; "
        "paper = kappa / (mean one-way delay seen by the router), seed App. B (default oracle)",
    )
    p.add_argument(
        "--ladder",
        choices=VERIFY_LADDERS,
        default="none",
        help="none = one run per scenario and policy with its drift certificate; full = also "
        "the Theorem-1 ladder (about 30 more runs each: the bound's constants, the T^-1/2 "
        "schedule, G1 against --tau-scales, the empirical eta0) (default none)",
    )
    p.add_argument(
        "--tau-scales",
        type=positive_float("tau-scales"),
        nargs="+",
        default=[1.0, 2.0, 4.0],
        help="with --ladder full: delay scales of the G1 fit (1 is always included; default 1 2 4)",
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
    from .._registry import flow_policy_names
    from .._verify import verify

    check_min_max(args.min_cells, args.max_cells, "--min-cells", "--max-cells")
    check_whole_ticks(args.horizon, args.tick)
    flows = list(flow_policy_names())
    if args.policy != "all" and args.policy not in flows:
        raise ValueError(
            f"--policy = {args.policy!r} is invalid: allowed policies are {flows + ['all']}"
        )
    given = None
    n = 64 if args.scenarios is None else args.scenarios
    if args.scenario is not None:
        import json

        if args.scenarios not in (None, 1):
            raise ValueError(
                f"--scenarios = {args.scenarios} is invalid with --scenario: one given "
                "scenario is verified (expected 1, or leave --scenarios out)"
            )
        load_scenario_arg(args.scenario, command="verify")  # checks it, names the field
        given = json.loads(Path(args.scenario).read_text())
        n = 1
    check_out_dir_on_main(args, args.out)
    res = verify(
        n,
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
        policies=None if args.policy == "all" else [args.policy],
        generator=args.generator,
        scenario=given,
        step_rule=args.step_rule,
        ladder=args.ladder,
        tau_scales=tuple(args.tau_scales),
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
        f = lambda v: "-" if v is None else f"{v:.3f}"
        rows.append(
            [
                pol,
                f(s["certificate_holds_fraction"]),
                f(s["bound_holds_fraction"]),
                q(s["B"]),
                q(s["schedule_slope"]),
                q(s["g1_growth_exponent"]),
                q(s["eta0_over_eta_star"]),
                f"{s['converged_fraction']:.3f}",
                s["failed"],
                q(s["time_average_distance"]),
                q(s["eta_over_eta_star"]),
            ]
        )
    rule = f"eta = {args.step_fraction} eta*" if args.step_rule == "oracle" else "paper step rule"
    print(
        f"{res['scenarios']} scenarios, seed {args.seed}, horizon {args.horizon} s, "
        f"tick {args.tick} s, {rule}, ladder {args.ladder}; devices {res['devices']}"
    )
    print(
        table(
            rows,
            [
                "policy",
                "certified",
                "under bound",
                "B q50 [q10, q90]",
                "T^-1/2 slope",
                "G1 exponent",
                "eta0/eta*",
                "converged",
                "failed",
                "time-avg distance",
                "eta/eta*",
            ],
        )
    )
    print(f"{res['wall_s']:.1f} s", file=sys.stderr)
    return 0
