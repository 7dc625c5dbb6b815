"""`dlbfluid experiment KIND`: the paper's evaluation (seed App. B) in the fluid model, and
with `--model requests` at request level beside it."""

from __future__ import annotations

from ._common import (
    add_process_options,
    check_out_dir_on_main,
    emit_json,
    fraction,
    positive_float,
    positive_int,
    seed_int,
    table,
)
from ._flags import EXPERIMENT, relabel


def register(sub) -> None:
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
    # (the groups in the order `--help` lists them)
    _add_size_flags(p)
    _add_run_flags(p)
    _add_policy_flags(p)
    _add_model_flags(p)
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    add_process_options(p)
    p.set_defaults(func=run)


def _add_size_flags(p) -> None:
    """Which experiment, how many scenarios and trials, from which stream, and where."""
    from .._evaluation.config import KINDS

    p.add_argument("kind", choices=KINDS, help="which experiment")
    p.add_argument(
        "--scenarios",
        type=positive_int("scenarios"),
        default=10,
        help="scenarios per variant (default 10)",
    )
    p.add_argument(
        "--trials", type=positive_int("trials"), default=5, help="trials per scenario (default 5)"
    )
    p.add_argument(
        "--seed", type=seed_int(), default=0, help="random stream, in [0, 2**63) (default 0)"
    )
    p.add_argument(
        "--out", metavar="DIR", default=None, help="output directory (default experiment-KIND)"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="run only these variants of the kind, by label (e.g. y=10 for duration, u=0.8 "
        "for utilization; default every variant); a directory resumes only with the same "
        "choice",
    )


def _add_run_flags(p) -> None:
    """Each run's horizon and tick, and the flow policies' step sizes."""
    from .._defaults import PROBE_TICK, STEP_RULES

    p.add_argument(
        "--horizon",
        type=positive_float("horizon"),
        default=600.0,
        help="simulated seconds (default 600)",
    )
    p.add_argument(
        "--tick",
        type=positive_float("tick"),
        default=PROBE_TICK,
        help=f"probe tick in seconds (default {PROBE_TICK:g}, the paper's probe cadence; the "
        "tick kind sweeps its own)",
    )
    p.add_argument(
        "--step-rule",
        choices=STEP_RULES,
        default="paper",
        help="flow step sizes: paper = kappa / (mean one-way delay seen by the router), kappa "
        "calibrated per cost family (seed App. B); oracle = --step-fraction x each scenario's "
        "critical eta* from the routers' model (default paper)",
    )
    p.add_argument(
        "--step-fraction",
        type=fraction("step-fraction"),
        default=0.3,
        help="with --step-rule oracle: the fraction of eta*, in (0, 1] (default 0.3)",
    )


def _add_policy_flags(p) -> None:
    """The policies compared, and the roots' error aversion."""
    from .._evaluation.config import POLICIES
    from .._registry import POLICIES as REGISTERED

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
    p.add_argument(
        "--mnlb-error-aversion",
        action="store_true",
        help="give MNLB DLB's error aversion too (default: none; the paper's MNLB is a "
        "separate, centralised system)",
    )


def _add_model_flags(p) -> None:
    """The fluid model alone, or the request-level runs beside it."""
    p.add_argument(
        "--model",
        default="fluid",
        metavar="fluid|requests",
        help="fluid: the fluid model (default); requests: also simulate every run request by "
        "request (dlbfluid.simulate_requests, one run per scenario and trial, seeded by "
        "--seed) and report its normalised mean and p90 latency and error rates beside the "
        "fluid means (the outage kind included: its replica schedule scales the cells)",
    )
    p.add_argument(
        "--service",
        default=None,
        metavar="markov|servers",
        help="with --model requests: the cells, markov (default: the birth-death process "
        "whose fluid limit is the fluid model) or servers (the App.-B prefill/decode servers "
        "the generator writes)",
    )
    p.add_argument(
        "--scale",
        default=None,
        metavar="K",
        help="with --model requests, an integer >= 1: the twin's arrival rates, replicas and "
        "buffers times K, so that the probed counts' noise shrinks as K^-1/2 (default 1)",
    )
    p.add_argument(
        "--probe-smoothing",
        default=None,
        metavar="T",
        help="with --model requests, a time constant T >= 0 (s): the routers see the probed "
        "counts through an exponential filter of time constant T (default 0: raw probes)",
    )
    p.add_argument(
        "--leaf",
        default=None,
        metavar="jsq|pod",
        help="with --model requests --service servers: the server a request joins in its "
        "cell, jsq (default) or pod (power-of-d choices on the tokens waiting)",
    )
    p.add_argument(
        "--pod-d",
        default=None,
        metavar="D",
        help="with --leaf pod, an integer >= 1: the servers drawn per request (default 2)",
    )
    from ._simulate import add_estimation_flags

    add_estimation_flags(p)


def _config(args):
    """The `ExperimentConfig` of the options; its refusals name the options."""
    from .._evaluation.config import MODELS, SERVICES, ExperimentConfig

    if args.model not in MODELS:
        raise ValueError(f"--model = {args.model!r} is invalid: allowed {', '.join(MODELS)}")
    if args.service is not None and args.service not in SERVICES:
        raise ValueError(f"--service = {args.service!r} is invalid: allowed {', '.join(SERVICES)}")
    if args.service is not None and args.model == "fluid":
        raise ValueError(
            f"--service = {args.service!r} is invalid with --model fluid: it chooses the "
            "request-level cells (--model requests)"
        )

    twin = _twin_options(args)
    pols = list(args.policies)
    if "rand" not in pols:
        raise ValueError(
            f"--policies = {pols} is invalid: 'rand' is required (latencies are normalised "
            "by Rand's)"
        )
    dup = sorted({p for p in pols if pols.count(p) > 1})
    if dup:
        raise ValueError(f"--policies = {pols} is invalid: {dup} named twice; expected each once")
    try:
        return ExperimentConfig(
            experiment=args.kind,
            scenarios=args.scenarios,
            trials=args.trials,
            seed=args.seed,
            horizon=args.horizon,
            tick=args.tick,
            step_rule=args.step_rule,
            step_fraction=args.step_fraction,
            policies=tuple(args.policies),
            variants=None if args.variants is None else tuple(args.variants),
            error_aversion=not args.no_error_aversion,
            mnlb_error_aversion=args.mnlb_error_aversion,
            model=args.model,
            service=args.service or "markov",
            **twin,
        )
    except ValueError as e:
        raise relabel(e, EXPERIMENT) from None


def _twin_options(args) -> dict:
    """`--scale`, `--probe-smoothing`, `--leaf`, `--pod-d` and the estimation's options
    (`--estimation`, `--refit-period`, `--estimation-window`, `--mitigation`) checked (one-line refusals,
    `dlbfluid simulate`'s wording) as `ExperimentConfig` fields; each needs
    `--model requests`."""
    from ._simulate import _smoothing, _whole, estimation_option, leaf_option

    given = {
        f: getattr(args, f)
        for f in ("scale", "probe_smoothing", "leaf", "pod_d", "estimation", "refit_period",
                  "estimation_window", "mitigation")
        if getattr(args, f, None) is not None
    }  # fmt: skip
    if given and args.model != "requests":
        f = next(iter(given))
        raise ValueError(
            f"{EXPERIMENT[f]} = {given[f]!r} is invalid with --model {args.model}: it sets the "
            "request-level twin (--model requests)"
        )
    out: dict = {}
    if args.scale is not None:
        out["scale"] = _whole("--scale", args.scale, 1)
    if args.probe_smoothing is not None:
        out["probe_smoothing"] = _smoothing(args.probe_smoothing)
    leaf = leaf_option(args, args.service or "markov")
    if leaf.name != "jsq":
        out["leaf"], out["pod_d"] = leaf.name, leaf.d
    online = estimation_option(args, args.service or "markov", None)
    if online is not None:
        out.update(
            estimation="online",
            refit_period=online.refit_period,
            estimation_window=online.window,
            probing=online.probing,
            shrinkage=online.shrinkage,
            dithering=online.dithering,
        )
    return out


def run(args) -> int:
    """Options, then `--out`, are checked before anything is drawn or simulated; the
    library's refusals (`ExperimentConfig`, the output directory's manifest) name the
    options (`dlbfluid._cli._flags.EXPERIMENT`). Progress goes to stderr unless
    `--no-progress`: redrawn on a terminal, otherwise one line every 10 s (a log file)."""
    from .._evaluation.experiment import run_experiment

    cfg = _config(args)
    out = args.out or f"experiment-{args.kind}"
    check_out_dir_on_main(args, out)
    res = run_experiment(
        cfg,
        out,
        progress=not args.no_progress,
        processes=getattr(args, "processes", None),
        labels=EXPERIMENT,
    )
    if res is None:  # not process 0: it prints and writes the merged results
        return 0
    res["out"] = str(out)
    if args.json:
        emit_json(res)
        return 0
    if cfg.model == "requests":
        print(_requests_table(res["summary"]))
        print(
            f"request level ({cfg.service} cells): mean and p90 latency over Rand's on the "
            "same scenario and trial; fluid: the fluid model's on the same scenarios"
        )
        print(f"results in {out}/ (results.csv, summary.csv, summary.json, {args.kind}.png)")
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


def _requests_table(summary: list[dict]) -> str:
    rows = [
        [
            s["variant"],
            s["policy"],
            _f(s["normalized_latency"]),
            _f(s["p90"]),
            _f(None if s["error_rate"] is None else 100 * s["error_rate"]),
            _f(s["fluid_normalized_latency"]),
            _f(None if s["fluid_error_rate"] is None else 100 * s["fluid_error_rate"]),
            _f(s["mean_latency"]),
            _f(s["p90_latency"]),
            s["failed"],
        ]
        for s in summary
    ]
    header = ["variant", "policy", "lat/rand", "p90/rand", "errors %", "fluid lat/rand",
              "fluid errors %", "latency (s)", "p90 (s)", "failed"]  # fmt: skip
    if any("sessions" in s for s in summary):  # (the affinity kind: its caches)
        for row, s in zip(rows, summary):
            sess = s.get("sessions") or {}
            row += [_f(None if sess.get(k) is None else 100 * sess[k])
                    for k in ("cache_hit_rate", "busiest_server_share", "session_move_rate")]  # fmt: skip
        header += ["cache hits %", "busiest server %", "sessions moved %"]
    return table(rows, header)


def _f(v):
    return "-" if v is None else f"{v:.4g}"
