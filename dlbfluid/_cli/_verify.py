"""`dlbfluid verify --scenarios N --seed S`: batch-verify Theorem 1 on random scenarios.

Per scenario and flow policy: Theorem 1's explicit bound (eta0, G1, A, C) checked on one run
with every estimate of its proof, the three step-size thresholds, the routers' projection
check as a diagnostic, and with `--ladder full` a descriptive fit of the bound's shape
(theory/lyapunov.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from .._defaults import PROBE_TICK, STEP_BASES, STEP_RULES, VERIFY_GENERATORS, VERIFY_LADDERS
from .._validate import check_search_range
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
from ._flags import VERIFY, relabel


def register(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="batch-verify flow-routing convergence (Theorem 1) on random scenarios",
        description="Draw random scenarios satisfying Assumptions 1-3 (or App.-B ones, or take "
        "one scenario file), solve their RIF, Wardrop and social-optimum equilibria, compute "
        "each flow policy's critical step size eta* for a whole chunk at once, simulate "
        "flow-rif, flow-lat and flow-grad, and report per scenario Theorem 1's verdict: its "
        "explicit constants (the proof's step threshold eta0, G1, A, C) and, for runs inside "
        "its hypothesis (eta <= eta0), whether the measured time-average distance lies under "
        "the bound, with every estimate of the proof measured against its own bound; then "
        "diagnostics: the routers' projection check, converged or not, time-average and final "
        "distance, eta/eta*, and with --ladder full a descriptive fit of the bound's shape. "
        "With --out, "
        "results are appended to DIR/results.jsonl as they are computed and a rerun with the "
        "same DIR resumes where a killed run stopped.",
    )
    # (the groups in the order `--help` lists them)
    _add_source_flags(p)
    _add_step_flags(p)
    _add_theorem1_flags(p)
    _add_run_flags(p)
    p.add_argument("--out", metavar="DIR", help="write results.jsonl and summary.json; resume")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    add_process_options(p)
    p.set_defaults(func=run)


def _add_source_flags(p) -> None:
    """Which scenarios and which flow policies."""
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


def _add_step_flags(p) -> None:
    """How each flow policy's step size is chosen (with `--step-fraction`)."""
    p.add_argument(
        "--step-rule",
        choices=STEP_RULES,
        default="oracle",
        help="flow step sizes: oracle = --step-fraction x the --step-base of each scenario; "
        "paper = kappa / (mean one-way delay seen by the router), seed App. B (default oracle)",
    )
    p.add_argument(
        "--step-base",
        choices=STEP_BASES,
        default="eta-star",
        help="what --step-fraction multiplies: eta-star = the linear critical step; eta0 = "
        "the proof's threshold, so that a fraction <= 1 runs inside Theorem 1's hypothesis "
        "(default eta-star)",
    )


def _add_theorem1_flags(p) -> None:
    """What is measured beyond the one run: the global threshold's search and the
    descriptive ladder."""
    p.add_argument(
        "--worst-case",
        action="store_true",
        help="also bracket each scenario's global step threshold eta_g (a coarse ladder over "
        "--search-range, then bisection to --bracket-tol, from --starts drawn starts and 2 "
        "adversarial ones per scenario; a cycle counts only when its re-run at half the tick "
        "for twice the horizon keeps amplitude and period; theory/global_threshold.md): the "
        "bracket, its censoring, eta_g, bistable, the Hopf direction and a verified witness",
    )
    p.add_argument(
        "--starts",
        type=positive_int("starts"),
        default=16,
        help="with --worst-case: drawn starts per scenario and step (default 16)",
    )
    p.add_argument(
        "--search-range",
        nargs=2,
        type=positive_float("search-range"),
        metavar=("LO", "HI"),
        default=[0.25, 1.1],
        help="with --worst-case: the steps searched, in units of eta*, 0 < LO < HI "
        "(default 0.25 1.1)",
    )
    p.add_argument(
        "--bracket-tol",
        type=positive_float("bracket-tol"),
        default=0.01,
        help="with --worst-case: bisect until hi - lo <= tol * hi, tol in (0, 0.5) (default 0.01)",
    )
    p.add_argument(
        "--ladder",
        choices=VERIFY_LADDERS,
        default="none",
        help="none = one run per scenario and policy; full = also the descriptive ladder "
        "(about 30 more runs each: a fit of the bound's shape, the T^-1/2 schedule, the fitted "
        "B against --tau-scales, the empirical eta0) (default none)",
    )
    p.add_argument(
        "--tau-scales",
        type=positive_float("tau-scales"),
        nargs="+",
        default=[1.0, 2.0, 4.0],
        help="with --ladder full: delay scales of the G1 fit (1 is always included; default 1 2 4)",
    )


def _add_run_flags(p) -> None:
    """The random stream, the batches, the networks' size and each run's settings."""
    p.add_argument(
        "--seed", type=seed_int(), default=0, help="random stream, in [0, 2**63) (default 0)"
    )
    p.add_argument(
        "--chunk",
        type=positive_int("chunk"),
        default=None,
        help="scenarios per compiled batch and per write (default 32, or a quarter of a "
        "smaller run so that it shows progress)",
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
        help="step size as a fraction of --step-base (eta* or eta0; default 0.3)",
    )
    p.add_argument(
        "--conv-tol",
        type=positive_float("conv-tol"),
        default=1e-3,
        help="converged when max|N(T) - N*| <= tol * max(1, max N*) (default 1e-3)",
    )


def run(args) -> int:
    """Every option, the scenario file and `--out` are checked before anything is drawn;
    the library's refusals (`VerifyConfig`, the output directory's manifest) name the
    options (`dlbfluid._cli._flags.VERIFY`)."""
    from .._verify import verify

    n, given = _check(args)
    config = _config(args)
    res = verify(
        n,
        args.seed,
        config=config,
        out_dir=args.out,
        progress=not args.no_progress,
        processes=getattr(args, "processes", None),
        scenario=given,
        labels=VERIFY,
    )
    if res is None:  # not process 0: it prints and writes the merged results
        return 0
    records = res.pop("records")
    if args.json:
        emit_json({"summary": res, "scenarios": records})
        return 0
    _print_tables(res, args)
    print(f"dlbfluid verify: wall time {res['wall_s']:.1f} s", file=sys.stderr)
    return 0


def _check(args) -> tuple[int, dict | None]:
    """The checks of the options among themselves, the scenario file and `--out`:
    `(scenarios to verify, the given scenario or None)`."""
    from .._registry import flow_policy_names

    check_min_max(args.min_cells, args.max_cells, "--min-cells", "--max-cells")
    check_whole_ticks(args.horizon, args.tick)
    check_search_range(args.search_range, "--search-range")
    if not 0 < args.bracket_tol < 0.5:
        raise ValueError(
            f"--bracket-tol = {args.bracket_tol!r} is invalid: expected a number in (0, 0.5)"
        )
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
    return n, given


def _config(args):
    """The `VerifyConfig` of the options; its refusals name the options."""
    from .._verify import VerifyConfig

    try:
        return VerifyConfig(
            chunk=args.chunk,
            n_cells=(args.min_cells, args.max_cells),
            horizon=args.horizon,
            tick=args.tick,
            step_fraction=args.step_fraction,
            conv_tol=args.conv_tol,
            policies=None if args.policy == "all" else (args.policy,),
            generator=args.generator,
            step_rule=args.step_rule,
            ladder=args.ladder,
            tau_scales=tuple(args.tau_scales),
            step_base=args.step_base,
            worst_case=args.worst_case,
            starts=args.starts,
            search_range=tuple(args.search_range),
            bracket_tol=args.bracket_tol,
        )
    except ValueError as e:
        raise relabel(e, VERIFY) from None


def _v(v) -> str:
    """A quantile: a number, a censored bound as the summary writes it (`"< 0.25"`), or -."""
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v:.3g}"


def _q(d: dict | None) -> str:
    """A quantile summary: `q50 [q10, q90]`."""
    if not d or d.get("q50") is None and d.get("q10") is None:
        return "-"
    return f"{_v(d['q50'])} [{_v(d['q10'])}, {_v(d['q90'])}]"


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _of(c: dict | None) -> str:
    """`count/of` of a `{"count", "of", "fraction"}` block."""
    return "-" if not c or not c["of"] else f"{c['count']}/{c['of']}"


def _theorem1_row(pol: str, s: dict) -> list:
    """One policy's row of Theorem 1's verdict, with the runs behind each fraction."""
    t = s.get("theorem1") or {}
    ins, holds = t.get("in_hypothesis"), t.get("holds")
    return [
        pol,
        f"{_f(s['in_hypothesis_fraction'])} ({_of(ins)})" if ins else _f(
            s["in_hypothesis_fraction"]),
        f"{_f(s['theorem1_holds_fraction'])} ({_of(holds)})" if holds else _f(
            s["theorem1_holds_fraction"]),
        _q(s["tightness"]),
        t.get("fallback_step", "-"),
        _q(s["eta0_over_eta_star"]),
    ]  # fmt: skip


def _global_row(pol: str, s: dict) -> list:
    """One policy's row of the global threshold: the censoring counts, eta_g/eta* (bounds
    where censored), bistable, and where the run's step lies against the bracket."""
    g = s.get("eta_global") or {}
    place = s.get("step_vs_bracket") or {}
    return [
        pol,
        f"{g.get('bracketed', '-')}/{g.get('with_eta_star', '-')}",
        g.get("below_range", "-"),
        g.get("above_range", "-"),
        g.get("failed", "-"),
        _q(g.get("over_eta_star")),
        _f(s["bistable_fraction"]),
        " / ".join(str(place.get(k, "-")) for k in ("below_lo", "inside", "above_hi",
                                                    "undetermined")),
    ]  # fmt: skip


def _audit_row(pol: str, s: dict) -> list:
    """One policy's row of the proof's audit: each estimate's count of runs where it held."""
    est = (s.get("audit") or {}).get("estimates") or {}
    worst = min(est.values(), key=lambda c: c["fraction"] or 0.0, default=None)
    return [pol, len(est), _of(worst) if worst else "-"]


def _diagnostics_row(pol: str, s: dict) -> list:
    """One policy's row of the diagnostics (not the theorem's verdict)."""
    return [
        pol,
        _f(s["projection_check_holds_fraction"]),
        f"{s['converged_fraction']:.3f}",
        s["failed"],
        _q(s["time_average_distance"]),
        _q(s["eta_over_eta_star"]),
        _f(s["bound_holds_fraction"]),
        _q(s["empirical_eta0_over_eta_star"]),
    ]


def _print_tables(res: dict, args) -> None:
    """The run's line, Theorem 1's table, the global threshold's (with --worst-case), the
    audit's and the diagnostics' table."""
    pols = res["policies"].items()
    base = "eta*" if args.step_base == "eta-star" else "eta0"
    rule = f"eta = {args.step_fraction} {base}" if args.step_rule == "oracle" else "paper step rule"
    n_sc = res["scenarios"]
    print(
        f"{n_sc} scenario{'s' if n_sc != 1 else ''}, seed {args.seed}, horizon {args.horizon} s, "
        f"tick {args.tick} s, {rule}, ladder {args.ladder}; devices {res['devices']}"
    )
    print("Theorem 1 (the verdict: runs with eta <= eta0 against the explicit bound; "
          "(count/runs) behind each fraction)")  # fmt: skip
    header = ["policy", "in hypothesis", "bound holds", "bound/measured q50 [q10, q90]",
              "at fallback step", "eta0/eta*"]  # fmt: skip
    print(table([_theorem1_row(pol, s) for pol, s in pols], header))
    if all(not s["in_hypothesis_fraction"] for _, s in pols):
        # Say why the verdict columns are empty, and how to fill them.
        print(
            "  no run is inside the hypothesis (eta > eta0 everywhere): the bound is a "
            "reference only; --step-base eta0 --step-fraction 1 checks it"
        )
    if any(s.get("eta_global") for _, s in pols):
        print(
            "Global threshold eta_g (bracketed: a verified cycle at hi, none at lo; "
            "below/above range: censored, quantiles they could move shown as bounds)"
        )
        header = ["policy", "bracketed", "below range", "above range", "failed",
                  "eta_g/eta* q50 [q10, q90]", "bistable",
                  "step below lo / inside / above hi / undetermined"]  # fmt: skip
        print(table([_global_row(pol, s) for pol, s in pols], header))
    print("Audit (the proof's estimates: they catch a wrong constant or a bug, not "
          "divergence; they hold at any step on a correct run)")  # fmt: skip
    print(table([_audit_row(pol, s) for pol, s in pols],
                ["policy", "estimates", "runs where the weakest holds"]))  # fmt: skip
    print("Diagnostics (not the theorem's verdict)")
    header = ["policy", "projection check", "converged", "failed", "time-avg distance",
              "eta/eta*", "under fitted shape", "empirical eta0/eta*"]  # fmt: skip
    print(table([_diagnostics_row(pol, s) for pol, s in pols], header))
