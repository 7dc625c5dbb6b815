"""`dlbfluid simulate SCENARIO --policy P --step-size ETA --tick H --horizon T`, and
`--model requests`: the same scenario request by request (`simulate_requests`), one or
more policies, `--trials` runs each."""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from .._defaults import AFFINITY_MODES, MITIGATION_DEFAULTS, MITIGATION_FIELDS, SIMULATE_HORIZON
from ._common import (
    SEED_MAX,
    add_process_options,
    add_run_options,
    check_out_dir,
    check_whole_ticks,
    doing,
    emit_json,
    fraction,
    load_scenario_arg,
    nonneg_float,
    plural,
    positive_float,
    positive_int,
    step_size_warning,
    table,
    warn,
    write_json,
)
from ._flags import SIMULATE_REQUESTS, relabel


def add_integrator_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--integrator",
        choices=["fast", "accurate"],
        default="fast",
        help="fast: fixed-step RK4 with exact arrival integrals (default); "
        "accurate: adaptive diffrax Tsit5 with error control",
    )
    p.add_argument(
        "--substeps",
        type=positive_int("substeps"),
        default=None,
        help="RK4 steps per tick for --integrator fast (default: chosen from the cells' "
        "time scale, one step at millisecond ticks)",
    )
    p.add_argument(
        "--rtol",
        type=positive_float("rtol"),
        default=1e-8,
        help="relative tolerance for --integrator accurate (default 1e-8)",
    )
    p.add_argument(
        "--atol",
        type=positive_float("atol"),
        default=1e-10,
        help="absolute tolerance for --integrator accurate (default 1e-10)",
    )


def make_integrator(args):
    from .._simulate import Accurate, Fast

    if args.integrator == "fast":
        return Fast(substeps=args.substeps)  # (None: chosen per batch, Fast.for_batch)
    return Accurate(rtol=args.rtol, atol=args.atol)


def register(sub) -> None:
    from .._registry import POLICIES

    p = sub.add_parser(
        "simulate",
        help="simulate one routing policy on a scenario file",
        description="Integrate the delayed fluid model (workloads and routing) under one "
        "routing policy. SCENARIO is a JSON scenario file, or 'default' for the built-in "
        "4-cell scenario.",
    )
    p.add_argument("scenario", metavar="SCENARIO", help="scenario JSON file, or 'default'")
    p.add_argument(
        "--policy",
        choices=POLICIES.names(),
        action="append",
        default=None,
        help="routing policy (default flow-grad); with --model requests it may be repeated "
        "(--policy rand --policy flow-grad), each policy run on the same trials",
    )
    # (the groups in the order `--help` lists them)
    _add_request_flags(p)
    add_run_options(p, horizon=SIMULATE_HORIZON)
    p.add_argument(
        "--window",
        type=fraction("window"),
        default=0.5,
        help="fraction of the horizon, at its end, over which mean latency and "
        "throughput are averaged (default 0.5)",
    )
    p.add_argument(
        "--n-save",
        type=positive_int("n-save"),
        default=200,
        help="number of save intervals of the trajectory (default 200)",
    )
    add_integrator_options(p)
    _add_control_flags(p)
    add_process_options(p)
    p.set_defaults(func=run)


def _add_request_flags(p) -> None:
    """The group of `--model requests` (its values checked by `request_options`, so that
    a refusal is one line)."""
    g = p.add_argument_group(
        "request level (--model requests)",
        "Simulate the scenario request by request (dlbfluid.simulate_requests): Poisson "
        "arrivals, the policies' own routing from delayed request counts, random service. "
        "Statistics are over the --window; --integrator, --substeps, --rtol, --atol and the "
        "step-size check are the fluid model's and do not apply.",
    )
    g.add_argument(
        "--model",
        default="fluid",
        metavar="fluid|requests",
        help="fluid: integrate the fluid model (default); requests: the request-level twin",
    )
    g.add_argument(
        "--service",
        default=None,
        metavar="markov|servers",
        help="the cells: markov (default; the birth-death process whose fluid limit is the "
        "fluid model) or servers (the cells' App.-B prefill/decode servers; an M/M/1 cell "
        "without them: exponential FIFO servers)",
    )
    g.add_argument(
        "--scale",
        default=None,
        metavar="K",
        help="an integer >= 1: arrival rates, replicas and buffers times K (default 1)",
    )
    g.add_argument(
        "--trials",
        default=None,
        metavar="T",
        help=f"an integer >= 1: independent runs per policy (default {DEFAULT_TRIALS})",
    )
    g.add_argument(
        "--seed", default=None, metavar="S", help="the random stream, in [0, 2**63) (default 0)"
    )
    g.add_argument(
        "--leaf",
        default=None,
        metavar="jsq|pod",
        help="with --service servers, the server a request joins in its cell: jsq (default; "
        "the fewest requests present) or pod (power-of-d choices on the tokens waiting)",
    )
    g.add_argument(
        "--probe-smoothing",
        default=None,
        metavar="T",
        help="a time constant T >= 0 (s): the routers see each arc's probed counts through "
        "an exponential filter of time constant T (default 0: the raw probes)",
    )
    g.add_argument(
        "--pod-d",
        default=None,
        metavar="D",
        help="with --leaf pod, an integer >= 1: the servers drawn per request (default 2)",
    )
    add_estimation_flags(g)
    add_affinity_flag(g)


def add_affinity_flag(g) -> None:
    """`--affinity` (checked by `affinity_option`)."""
    g.add_argument(
        "--affinity",
        default=None,
        metavar="|".join(AFFINITY_MODES),
        help="with --service servers and a scenario whose workload has sessions: off "
        "(default; every request routed by the policy), sticky (a session follows its first "
        "request's cell and server) or conditional (the paper's rule: stay while the "
        "expected latency minus the prefill a cache hit saves beats the best other cell)",
    )


def affinity_option(args, service: str) -> str:
    """The checked `--affinity` (one line naming the option, its value and what is
    allowed); the scenario's sessions are checked by `simulate_requests`."""
    mode = getattr(args, "affinity", None)
    if mode is None:
        return "off"
    if mode not in AFFINITY_MODES:
        raise ValueError(f"--affinity = {mode!r} is invalid: allowed {', '.join(AFFINITY_MODES)}")
    if mode != "off" and service != "servers":
        raise ValueError(
            f"--affinity = {mode!r} is invalid with --service {service}: sessions and prefix "
            "caches need --service servers"
        )
    return mode


def add_estimation_flags(g) -> None:
    """`--estimation`, `--refit-period`, `--estimation-window`, `--mitigation` (checked
    by `estimation_option`)."""
    g.add_argument(
        "--estimation",
        default=None,
        metavar="oracle|online",
        help="the routers' latency models: oracle (default; the scenario's, fixed) or online "
        "(with --service servers: each cell's softplus model refitted in the loop from the "
        "requests completed in a sliding window)",
    )
    g.add_argument(
        "--refit-period",
        default=None,
        metavar="P",
        help="with --estimation online, seconds between refits, a whole number of ticks "
        "(default 5)",
    )
    g.add_argument(
        "--estimation-window",
        default=None,
        metavar="W",
        help="with --estimation online, seconds of completions a refit uses, a whole number "
        "of refit periods (default 60)",
    )
    g.add_argument(
        "--mitigation",
        action="append",
        default=None,
        metavar="NAME[=VALUE]",
        help="with --estimation online, repeatable: background-probing[=PERIOD s, default "
        f"{MITIGATION_DEFAULTS['background-probing']}], shrinkage[=PRIOR SAMPLES, default "
        f"{MITIGATION_DEFAULTS['shrinkage']:g}], dithering[=SIGMA, default "
        f"{MITIGATION_DEFAULTS['dithering']}]",
    )


def estimation_option(args, service: str, tick: float | None):
    """The checked `--estimation`, `--refit-period`, `--estimation-window` and
    `--mitigation`: None for the oracle, else an `OnlineEstimation` whose periods are whole
    numbers of `tick` (None: not checked here; `experiment` checks each variant's tick in
    `ExperimentConfig`); one-line refusals naming the option."""
    from .._defaults import ESTIMATION_MODES
    from .._requests.estimation import OnlineEstimation
    from .._validate import period_ticks

    mode = getattr(args, "estimation", None) or "oracle"
    if mode not in ESTIMATION_MODES:
        raise ValueError(
            f"--estimation = {mode!r} is invalid: allowed {', '.join(ESTIMATION_MODES)}"
        )
    extra = {
        "refit_period": getattr(args, "refit_period", None),
        "estimation_window": getattr(args, "estimation_window", None),
        "mitigation": getattr(args, "mitigation", None),
    }
    if mode == "oracle":
        for name, value in extra.items():
            if value is not None:
                raise ValueError(
                    f"--{name.replace('_', '-')} = {value!r} is invalid without --estimation online"
                )
        return None
    if service != "servers":
        raise ValueError(
            f"--estimation = 'online' is invalid with --service {service}: markov cells do "
            "not fix a request's latency at its admission (use --service servers)"
        )
    kw: dict = {}
    for name, field in (("refit_period", "refit_period"), ("estimation_window", "window")):
        if extra[name] is not None:
            try:
                kw[field] = positive_float(name)(extra[name])
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--{name.replace('_', '-')} = {e} (seconds)") from None
    for item in extra["mitigation"] or []:
        name, eq, value = item.partition("=")
        if name not in MITIGATION_DEFAULTS:
            raise ValueError(
                f"--mitigation = {item!r} is invalid: allowed "
                f"{', '.join(MITIGATION_DEFAULTS)} (each optionally =VALUE)"
            )
        field = MITIGATION_FIELDS[name]
        if field in kw:
            raise ValueError(f"--mitigation = {item!r} is invalid: {name} is named twice")
        if not eq:
            kw[field] = MITIGATION_DEFAULTS[name]
            continue
        try:
            v = positive_float(name)(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--mitigation {name} = {e}") from None
        if name == "dithering" and v > 2.0:
            raise ValueError(
                f"--mitigation = {item!r} is invalid: dithering's sigma must be in (0, 2]"
            )
        kw[field] = v
    try:
        online = OnlineEstimation(**kw)
    except ValueError as e:
        msg = str(e).replace("refit_period =", "--refit-period =")
        raise ValueError(msg.replace("window =", "--estimation-window =", 1)) from None
    if tick is not None:
        period_ticks(online.refit_period, tick, "--refit-period")
        if online.probing > 0:
            period_ticks(online.probing, tick, "--mitigation background-probing")
    return online


def _add_control_flags(p) -> None:
    """What is refused or checked before the run, and what it writes and shows."""
    p.add_argument(
        "--allow-overload",
        action="store_true",
        help="simulate even if demand exceeds what any routing can serve",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument(
        "--out", metavar="DIR", help="write trajectory.npz, summary.json and trajectory.png to DIR"
    )
    p.add_argument("--no-progress", action="store_true", help="never show progress")
    p.add_argument(
        "--no-step-check",
        action="store_true",
        help="skip the comparison of a flow policy's --step-size with its critical step size "
        "eta* (one equilibrium solve and a linear stability test before the run)",
    )


DEFAULT_TRIALS = 10
"""`--trials` of `--model requests` unless given (90% intervals need at least 2)."""
MODELS = ("fluid", "requests")
"""`--model`: the fluid model, or the request-level twin."""
SERVICES = ("markov", "servers")
"""`--service`: the request-level cells (`simulate_requests(service=...)`)."""
SETTLED = 0.01
"""A run counts as settled when no workload swings by more than this fraction of the
largest final workload (at least 1 request) over the last 25% of the horizon."""


def unsettled_note(oscillation: float, final_N) -> str | None:
    """What to say when the run ends before its workloads settle (`SETTLED`): a transient
    still decaying, or a sustained oscillation; None when settled."""
    scale = max(1.0, float(np.max(np.abs(np.asarray(final_N)))))
    if not oscillation > SETTLED * scale:  # (NaN: the status says what went wrong)
        return None
    return (
        f"not settled: a workload still swings by {oscillation:.3g} ({oscillation / scale:.1%} "
        "of the largest) over the last 25% of the horizon: a transient still decaying (a "
        "longer --horizon) or a sustained oscillation (discrete routing herds; a flow "
        "--step-size above eta*)"
    )


STEP_RATIO_WARN = 1.0
"""`simulate` warns when a flow policy's step size exceeds this multiple of $\\eta^*$."""


def step_check(scn, policy: str, step_size: float, allow_overload: bool) -> dict:
    """The plausibility check of a flow policy's step size (`step_size_ratio`,
    theory/stability.md §3.8): `{"step_size", "critical_step_size", "ratio", "method"}`, or
    `{"ratio": None, "reason": ...}` when there is no equilibrium to linearise around
    (overload under `--allow-overload`) or the test is refused. Only for a flow policy
    (`flow_policy_names`, the policies with a step size)."""
    from .._errors import OverloadError
    from .._stability import step_size_ratio

    try:
        return step_size_ratio(scn, policy, step_size)
    except OverloadError as e:
        if not allow_overload:
            raise
        return {"step_size": step_size, "critical_step_size": None, "ratio": None,
                "method": None, "reason": f"no equilibrium: {e}"}  # fmt: skip
    except RuntimeError as e:
        return {"step_size": step_size, "critical_step_size": None, "ratio": None,
                "method": None, "reason": str(e)}  # fmt: skip


def _latency_text(summary: dict) -> str:
    """The mean latency, or why there is none: no request arrived in the window (zero
    demand), or every one was dropped."""
    lat = summary["mean_latency"]
    if math.isfinite(lat) or summary["status"] != "success":
        return f"{lat:.6g} s"
    err = summary["error_rate"]
    if not math.isfinite(err):
        return "n/a (no arrivals in the window)"
    return "n/a (every arrival in the window was dropped)"


def _whole(flag: str, text: str, lo: int, hi: int | None = None, shown: str = "") -> int:
    """The integer `text` of option `flag` in `[lo, hi]`, or a one-line `ValueError` naming
    the flag, the value and what is allowed."""
    try:
        v: int | None = int(text.strip())
    except ValueError:
        v = None
    if v is None or v < lo or (hi is not None and v > hi):
        allowed = shown or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
        raise ValueError(f"{flag} = {text!r} is invalid: expected {allowed}")
    return v


def request_options(args) -> dict | None:
    """The checked request-level options (`model`, `service`, `scale`, `trials`, `seed`,
    `policies`), or `None` for the fluid model; every refusal is one line naming the
    option, its value and what is allowed. The fluid model takes one `--policy` and none of
    the request-level options."""
    if args.model not in MODELS:
        raise ValueError(f"--model = {args.model!r} is invalid: allowed {', '.join(MODELS)}")
    policies = list(args.policy or ["flow-grad"])
    if args.model == "fluid":
        for name in ("service", "scale", "trials", "seed", "leaf", "pod_d", "probe_smoothing",
                     "estimation", "refit_period", "estimation_window", "mitigation",
                     "affinity"):  # fmt: skip
            value = getattr(args, name, None)
            if value is not None:
                raise ValueError(
                    f"--{name.replace('_', '-')} = {value!r} is invalid with --model fluid: "
                    "it applies to --model requests only"
                )
        if len(policies) > 1:
            raise ValueError(
                f"--policy = {policies} is invalid with --model fluid: expected one policy "
                "(--model requests takes several)"
            )
        return None
    dup = sorted({p for p in policies if policies.count(p) > 1})
    if dup:
        raise ValueError(f"--policy = {policies} is invalid: {dup} named twice; expected each once")
    service = "markov" if args.service is None else args.service
    if service not in SERVICES:
        raise ValueError(f"--service = {service!r} is invalid: allowed {', '.join(SERVICES)}")
    return {
        "leaf": leaf_option(args, service),
        "probe_smoothing": _smoothing(args.probe_smoothing),
        "estimation": estimation_option(args, service, args.tick),
        "affinity": affinity_option(args, service),
        "model": "requests",
        "service": service,
        "scale": 1 if args.scale is None else _whole("--scale", args.scale, 1),
        "trials": DEFAULT_TRIALS if args.trials is None else _whole("--trials", args.trials, 1),
        "seed": 0
        if args.seed is None
        else _whole("--seed", args.seed, 0, SEED_MAX, "an integer in [0, 2**63)"),
        "policies": policies,
    }


def _smoothing(text) -> float:
    """`--probe-smoothing` as seconds >= 0 (0 when not given; `nonneg_float`'s check), or a
    one-line refusal naming the option."""
    if text is None:
        return 0.0
    try:
        return nonneg_float("probe_smoothing")(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--probe-smoothing = {e} (seconds)") from None


def leaf_option(args, service: str):
    """The checked `--leaf` and `--pod-d` as an `AbstractLeaf` (`PowerOfD(d)` or
    `JoinShortestQueue()`); one-line refusals: an unknown rule, `pod` without
    `--service servers`, `--pod-d` without `--leaf pod` or below 1."""
    from .._requests._leaf import LEAF_RULES, JoinShortestQueue, PowerOfD

    leaf = getattr(args, "leaf", None) or "jsq"
    d = getattr(args, "pod_d", None)
    if leaf not in LEAF_RULES:
        raise ValueError(f"--leaf = {leaf!r} is invalid: allowed {', '.join(LEAF_RULES)}")
    if leaf == "jsq":
        if d is not None:
            raise ValueError(f"--pod-d = {d!r} is invalid without --leaf pod: it sets pod's d")
        return JoinShortestQueue()
    if service != "servers":
        raise ValueError(
            f"--leaf = {leaf!r} is invalid with --service {service}: markov cells have no "
            "servers to choose from (use --service servers)"
        )
    return PowerOfD(2 if d is None else _whole("--pod-d", d, 1))


def run(args) -> int:
    """Every option, the scenario and `--out` are checked before the simulation starts
    (exit status 2). With zero demand over the averaging window the mean latency is
    undefined: null in JSON, "n/a (no arrivals in the window)" in the text output."""
    procs = getattr(args, "processes", None)
    if procs is not None and not procs.main:
        return 0  # one scenario: process 0 simulates it, the others wait (`finish`)
    req = request_options(args)
    if req is not None:
        return run_requests(args, req)
    args.policy = args.policy[0] if args.policy else "flow-grad"
    check_whole_ticks(args.horizon, args.tick)
    scn = load_scenario_arg(args.scenario, allow_overload=args.allow_overload, command="simulate")
    out = check_out_dir(args.out)
    from .._registry import flow_policy_names

    flow = args.policy in flow_policy_names()  # (the policies with a step size)
    note = step_size_warning(args.step_size, args.tick)
    if note and flow:
        warn("simulate", note)
    check = None
    if not args.no_step_check and flow:
        check = _step_check_warned(scn, args)
    t0 = time.perf_counter()
    sol = _simulate_fluid(scn, args)
    wall = time.perf_counter() - t0
    summary = sol.summary(args.window)
    unsettled = unsettled_note(summary["oscillation"], summary["final"]["N"])
    if unsettled and summary["status"] == "success":
        warn("simulate", unsettled)
    summary["scenario"] = scn.name
    summary["step_size"] = args.step_size
    summary["step_size_check"] = check
    summary["wall_s"] = wall
    if out is not None:
        _write_fluid(out, sol, summary, scn, args)
    if args.json:
        emit_json(summary)
    else:
        _print_fluid(summary, scn, args)
    return 0 if summary["status"] == "success" else 1


def _step_check_warned(scn, args) -> dict:
    """`step_check` of `--policy` and `--step-size`, with a warning above
    `STEP_RATIO_WARN` times eta*."""
    doing("simulate", f"comparing --step-size with {args.policy}'s critical step size")
    check = step_check(scn, args.policy, args.step_size, args.allow_overload)
    if check["ratio"] is not None and check["ratio"] > STEP_RATIO_WARN:
        warn(
            "simulate",
            f"--step-size = {args.step_size:g} is {check['ratio']:.3g} times the critical "
            f"step size eta* = {check['critical_step_size']:.3g} of the linearised model "
            "(dlbfluid stability): expect oscillation, not convergence",
        )
    return check


# A run of more ticks than this shows progress when stderr is not a terminal.
LONG_RUN_TICKS = 20000


def _show_progress(args, ticks: float) -> bool:
    """Progress lines for `simulate`, fluid or request-level: on a terminal, or for a run
    of more than `LONG_RUN_TICKS` ticks; never with `--no-progress`."""
    return not args.no_progress and (sys.stderr.isatty() or ticks > LONG_RUN_TICKS)


def _simulate_fluid(scn, args):
    """The fluid run of `--policy` (`simulate(..., throw=False)`), with progress on a
    terminal or for a long run."""
    from .._simulate import simulate

    n_save = min(args.n_save, max(1, int(round(args.horizon / args.tick))))
    ticks = args.horizon / args.tick
    show = _show_progress(args, ticks)
    doing(
        "simulate",
        f"simulating {args.policy} for {plural(int(round(ticks)), 'tick')} of {args.tick:g} s",
    )
    return simulate(
        scn,
        args.policy,
        step_size=args.step_size,
        tick=args.tick,
        horizon=args.horizon,
        n_save=n_save,
        integrator=make_integrator(args),
        progress=show,
        throw=False,
    )


def _write_fluid(out, sol, summary: dict, scn, args) -> None:
    """`--out`: trajectory.npz, summary.json and trajectory.png."""
    from .._plot import plot_trajectories

    np.savez(out / "trajectory.npz", **sol.to_numpy())
    write_json(out / "summary.json", summary)
    plot_trajectories(
        sol, out / "trajectory.png", title=f"{scn.name}: {args.policy}", window=args.window
    )


def _print_fluid(summary: dict, scn, args) -> None:
    """The run's line, its mean latency, each cell's final workload and throughput."""
    n = len(summary["final"]["N"])
    names = summary["cells"] or [f"cell{j}" for j in range(n)]
    print(
        f"scenario {scn.name!r}, policy {args.policy}, eta {args.step_size}, "
        f"tick {args.tick} s, horizon {summary['horizon']} s, status {summary['status']}"
    )
    print(f"mean end-to-end latency (last {args.window:.0%}): {_latency_text(summary)}")
    for j in range(n):
        print(
            f"  {names[j]:>14}: N(T) = {summary['final']['N'][j]:10.5g}   "
            f"throughput = {summary['throughput'][j]:10.5g} req/s"
        )
    print(
        f"change over the last tick: {summary['final_change']:.3g}; "
        f"oscillation (last 25%): {summary['oscillation']:.3g}"
    )
    if args.out:
        print(f"wrote {args.out}/trajectory.npz, summary.json, trajectory.png")


def run_requests(args, req: dict) -> int:
    """`--model requests`: `simulate_requests(..., throw=False)` for every `--policy` on
    the same `--trials` random streams, statistics over the `--window` (the warm-up is the
    horizon before it). Prints, per policy, `RequestSolution.summary()` (docs/cli.md,
    *dlbfluid simulate --model requests*); the exit status is 1 when any policy's status is not `success`."""
    from .._requests import simulate_requests

    K = check_whole_ticks(args.horizon, args.tick)
    scn = load_scenario_arg(args.scenario, allow_overload=args.allow_overload, command="simulate")
    w = scn.workload
    if w is not None and float(w.session_fraction) > 0 and req["service"] != "servers":
        raise ValueError(
            f"--service = {req['service']!r} is invalid: the scenario's workload has sessions, "
            "which need --service servers (prefix caches live in the FIFO servers)"
        )
    out = check_out_dir(args.out)
    from .._registry import flow_policy_names

    note = step_size_warning(args.step_size, args.tick)
    if note and any(p in flow_policy_names() for p in req["policies"]):
        warn("simulate", note)
    n_save = min(args.n_save, K)
    warmup = max(0.0, args.horizon - args.window * args.horizon)
    show = _show_progress(args, K)
    results: dict[str, dict] = {}
    arrays: dict = {}  # (counts.npz: the save times and each policy's counts)
    t0 = time.perf_counter()
    for pol in req["policies"]:
        doing(
            "simulate",
            f"simulating {pol} request by request ({req['service']} cells, scale "
            f"{req['scale']}, {plural(req['trials'], 'trial')} of {plural(K, 'tick')} of {args.tick:g} s)",
        )
        try:
            sol = simulate_requests(
                scn,
                pol,
                service=req["service"],
                leaf=req["leaf"],
                probe_smoothing=req["probe_smoothing"],
                estimation=req["estimation"] or "oracle",
                affinity=req["affinity"],
                scale=req["scale"],
                trials=req["trials"],
                seed=req["seed"],
                step_size=args.step_size,
                tick=args.tick,
                horizon=args.horizon,
                warmup=warmup,
                n_save=n_save,
                throw=False,
                progress=show,
            )
        except ValueError as e:
            raise relabel(e, SIMULATE_REQUESTS) from None
        results[pol] = sol.summary()
        arrays["t"] = np.asarray(sol.t)
        arrays[f"count_{pol}"] = np.asarray(sol.count)
    wall = time.perf_counter() - t0
    bad = [r["status"] for r in results.values() if r["status"] != "success"]
    n = len(next(iter(results.values()))["cells"])
    summary = {
        "model": req["model"],
        "service": req["service"],
        "leaf": req["leaf"].describe(),
        "probe_smoothing": req["probe_smoothing"],
        "estimation": {"mode": "oracle"}
        if req["estimation"] is None
        else req["estimation"].describe(),
        "affinity": req["affinity"],
        "scale": req["scale"],
        "seed": req["seed"],
        "trials": req["trials"],
        "scenario": scn.name,
        "cells": list(scn.cell_names) or [f"cell{j}" for j in range(n)],
        "horizon": args.horizon,
        "tick": args.tick,
        "step_size": args.step_size,
        "window": args.window,
        "warmup": warmup,
        "status": bad[0] if bad else "success",
        "policies": results,
        "wall_s": wall,
    }
    if out is not None:
        np.savez(out / "counts.npz", **arrays)
        write_json(out / "summary.json", summary)
    if args.json:
        emit_json(summary)
    else:
        _print_requests(summary, args)
    return 0 if not bad else 1


def _g(v, scale: float = 1.0) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{scale * v:.4g}"


def _print_requests(summary: dict, args) -> None:
    print(
        f"scenario {summary['scenario']!r}, request level ({summary['service']} cells, scale "
        f"{summary['scale']}), {plural(summary['trials'], 'trial')}, seed {summary['seed']}, eta "
        f"{summary['step_size']}, tick {summary['tick']} s, horizon {summary['horizon']} s"
    )
    print(
        f"end-to-end latency of the requests served in the last {args.window:.0%} (s); "
        "+-: 90% half-width across trials"
    )
    rows = []
    for pol, r in summary["policies"].items():
        lat, ci = r["latency"], r["latency_ci90"]
        rows.append(
            [pol, r["status"], _g(lat["mean"]), _g(ci["mean"]), _g(lat["p50"]), _g(lat["p90"]),
             _g(ci["p90"]), _g(lat["p99"]), _g(r["error_rate"], 100), r["served"]]
        )  # fmt: skip
    header = ["policy", "status", "mean", "+-", "p50", "p90", "+-", "p99", "errors %", "served"]
    print(table(rows, header))
    print("per cell, time averages over the window: requests present / utilisation")
    names = summary["cells"]
    rows = [
        [names[j]]
        + [
            f"{_g(r['cells'][j]['mean_requests'])} / {_g(r['cells'][j]['utilisation'])}"
            for r in summary["policies"].values()
        ]
        for j in range(len(names))
    ]
    print(table(rows, ["cell", *summary["policies"]]))
    with_sessions = [(p, r) for p, r in summary["policies"].items() if "cache_hit_rate" in r]
    if with_sessions:
        print(f"sessions, affinity {summary['affinity']}: prefix-cache hits and the busiest "
              "server's share of the requests admitted in the window (%)")  # fmt: skip
        rows = [
            [p, _g(r["cache_hit_rate"], 100), _g(r["busiest_server_share"], 100)]
            for p, r in with_sessions
        ]
        print(table(rows, ["policy", "cache hits %", "busiest server %"]))
    if args.out:
        print(f"wrote {args.out}/summary.json, counts.npz")
