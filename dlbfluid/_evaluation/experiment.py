"""The paper's evaluation (seed §5.4, App. B) in the fluid model: generated scenarios,
the six DLB policies against Rand and MNLB, bursts, outages, spikes, duration scaling and
estimation noise (theory/evaluation.md).

An experiment is a list of *variants* (e.g. utilisation 0.5 ... 0.95); each variant draws
`scenarios` scenarios from the App-B generator (`generator.generate`, seeded by
`(seed, index)`) and `trials` arrival-rate fluctuation trials of each, and simulates the
whole `scenarios x trials` batch under each policy in one vmapped call. The unit of work is
one `(variant, policy)` batch: its rows are appended to `results.csv` and fsync'ed
together, so a killed run resumes at the first unit that is not complete, and a torn
last unit is dropped and recomputed (never duplicated): the resumable sweep
`dlbfluid._runtime.Sweep` that `verify` runs too, with a `CsvRows` results file.

With `model="requests"` (`ExperimentConfig.model`) every unit is simulated twice on the
same batch and step sizes: by the fluid model, as above, and request by request
(`simulate_requests`, one run per scenario and trial, `ExperimentConfig.service` cells),
whose mean and 90th-percentile latency and error rate are the unit's results, the fluid
mean latency and error rate beside them (`REQUEST_FIELDS`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .._equilibrium import solve_equilibrium
from .._integrators import Fast
from .._plot import plot_summary as plot_summary
from .._policies import MNLB, ErrorAverse, FlowRouting, policy_from_name
from .._policies.aversion import ErrorAversion
from .._precision import require_x64
from .._requests import simulate_requests
from .._requests._leaf import PowerOfD
from .._requests.estimation import OnlineEstimation
from .._runtime import CsvRows, Sweep
from .._runtime.distributed import Processes
from .._runtime.manifest import MANIFEST, open_manifest, resume_note
from .._runtime.progress import Progress
from .._scenario import scenario_from_dict, stack_scenarios
from .._service.estimation import fit_latency_model, perturb_service, sample_latency
from .._simulate import simulate
from .._stability import batch_critical_step_size
from .config import (
    AFFINITY_SESSIONS,
    RECOVERY_SAVE,
    RECOVERY_SLOWDOWN,
    RECOVERY_TOLERANCE,
    ExperimentConfig,
)
from .config import KINDS as KINDS
from .config import POLICIES as POLICIES
from .generator import TOKEN_TIME_CV, _generate_kept, scenario_dicts
from .step_rule import padded, paper_step_sizes

FIT_SAMPLES = 500

FIELDS = (
    "experiment",
    "variant",
    "policy",
    "scenario",
    "trial",
    "n_cells",
    "utilisation",
    "step_size",
    "mean_latency",
    "error_rate",
    "status",
)

REQUEST_FIELDS = ("p90_latency", "fluid_mean_latency", "fluid_error_rate", "fluid_status")
"""The columns a request-level experiment's `results.csv` adds to `FIELDS`: the run's 90th
percentile latency (its `mean_latency`, `error_rate` and `status` are the request-level
run's), and the fluid model's mean latency, error rate and status on the same scenario,
trial and step sizes."""


ESTIMATION_FIELDS = ("estimate_age_max", "estimate_samples_min", "estimate_stale_cells")
"""The columns an online-estimation experiment adds (`ExperimentConfig.estimation`): per
run, the oldest of its cells' latency models at the horizon (s since its last accepted
fit), the fewest samples in a cell's last window, and the cells whose model is at least a
window old (no accepted fit in the last window: starved or censored out)."""


RECOVERY_FIELDS = ESTIMATION_FIELDS + ("slowed_cell", "slowed_share")
"""The columns of a `recovery` experiment: `ESTIMATION_FIELDS` (empty for the oracle
variant), the slowed cell's index, and its share of the requests delivered in each interval
of `RECOVERY_SAVE` seconds (space-separated, 6 significant digits; `nan` for an interval
without deliveries): what `recovery_times` compares with the oracle run's."""


AFFINITY_FIELDS = ("cache_hit_rate", "busiest_server_share", "session_move_rate")
"""The columns of an `affinity` experiment: per run, the share of the requests admitted in
the window that hit their server's prefix cache, the largest share of them that one
server admitted, and the share of the session requests with a cell to return to that were
routed to another (`RequestSolution.cache_hit_rate`, `busiest_server_share`,
`session_move_rate`)."""


def fields(cfg: ExperimentConfig) -> tuple[str, ...]:
    """The columns of `cfg`'s `results.csv`: `FIELDS`, plus `REQUEST_FIELDS` at request
    level (a fluid run's file is the one written before the twin existed), plus
    `ESTIMATION_FIELDS` with online estimation (`RECOVERY_FIELDS` for `recovery`,
    `AFFINITY_FIELDS` for `affinity`)."""
    if cfg.model != "requests":
        return FIELDS
    if cfg.experiment == "recovery":
        return FIELDS + REQUEST_FIELDS + RECOVERY_FIELDS
    if cfg.experiment == "affinity":
        return FIELDS + REQUEST_FIELDS + AFFINITY_FIELDS
    extra = ESTIMATION_FIELDS if cfg.estimation == "online" else ()
    return FIELDS + REQUEST_FIELDS + extra


# ----------------------------------------------------------------------------------------
# Building one variant's batch
# ----------------------------------------------------------------------------------------


def _variant_batch(cfg: ExperimentConfig, options: dict):
    """The `scenarios x trials` batch of one variant (trial-major inside each scenario),
    plus the nominal scenarios (no trial noise, no event) used for step sizes, as the
    routers see them: where the routers' model differs from the truth (`noise`, `fit`),
    a nominal scenario's service is the routers' model, so that nothing a router computes
    (costs, step sizes) comes from the true one."""
    gen = _generate_kept(
        cfg.seed,
        cfg.scenarios,
        utilisation=options.get("utilisation", cfg.utilisation),
        duration_scale=options.get("duration_scale", 1.0),
        token_time_cv=options.get("token_time_cv", TOKEN_TIME_CV),
    )
    event = options.get("event", "none")
    slowdown = options.get("slowdown")
    nominal = [
        scenario_from_dict(d) for d in scenario_dicts(gen, horizon=cfg.horizon, fluctuation=0.0)
    ]
    per_trial = [
        scenario_dicts(gen, event=event, trial=t, horizon=cfg.horizon, fluctuation=cfg.fluctuation)
        for t in range(cfg.trials)
    ]
    if slowdown is not None:
        # The recovery kind: one real cell of each scenario, the first of the outage's
        # order (drawn at draw time), serves `factor` times slower on [start, end) x horizon.
        factor, start, end = slowdown
        schedule = {"times": [0.0, start * cfg.horizon, end * cfg.horizon],
                    "factors": [1.0, factor, 1.0]}  # fmt: skip
        for dicts in per_trial:
            for s, d in enumerate(dicts):
                j = next(int(o) for o in gen.outage_order[s] if gen.mask[s, o])
                d["cells"][j]["service_schedule"] = dict(schedule)
    if "affinity" in options:
        # The affinity kind: every scenario's requests in sessions (`AFFINITY_SESSIONS`).
        for dicts in per_trial:
            for d in dicts:
                d["workload"] = {**d["workload"], "sessions": dict(AFFINITY_SESSIONS)}
    scns = []
    for s in range(cfg.scenarios):
        for t in range(cfg.trials):
            scns.append(scenario_from_dict(per_trial[t][s], allow_overload=True))
    eps = options.get("noise")
    if eps:
        # One perturbation per scenario (the same for all its trials), seeded by its index.
        est = [
            perturb_service(scns[s * cfg.trials].service, eps, cfg.seed * 1_000_003 + s)
            for s in range(cfg.scenarios)
        ]
        scns = [dataclasses.replace(sc, estimate=est[k // cfg.trials]) for k, sc in enumerate(scns)]
    if options.get("fit"):
        scns = _with_fitted_models(cfg, scns)
    if eps or options.get("fit"):
        views = [scns[s * cfg.trials].estimate for s in range(cfg.scenarios)]
        nominal = [dataclasses.replace(n, service=e, estimate=e) for n, e in zip(nominal, views)]
    util = gen.total_utilisation()
    # Pad to the generator's largest size so every variant reuses one compilation.
    return nominal, stack_scenarios(scns, n_cells=gen.max_cells), np.asarray(util, dtype=float)


def _with_fitted_models(cfg: ExperimentConfig, scns: list) -> list:
    """Routers use softplus models fitted (`fit_latency_model`) to `FIT_SAMPLES` noisy
    latency samples per cell (`sample_latency`, 5% lognormal noise), one fit per cell of
    every scenario in one vmapped call; the same fit for all trials of a scenario."""
    firsts = [scns[s * cfg.trials] for s in range(cfg.scenarios)]
    sizes = [int(np.asarray(f.cell_mask).sum()) for f in firsts]
    flat = jax.tree_util.tree_map(
        lambda *a: jnp.concatenate(a), *[_cells(f.service, n) for f, n in zip(firsts, sizes)]
    )
    N, y = sample_latency(flat, cfg.seed, FIT_SAMPLES, noise=0.05)
    fitted, _ = fit_latency_model(N, y)
    bounds = np.cumsum([0] + sizes)
    est = [
        jax.tree_util.tree_map(lambda a, lo=lo, hi=hi: a[lo:hi], fitted)
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    return [dataclasses.replace(sc, estimate=est[k // cfg.trials]) for k, sc in enumerate(scns)]


def _cells(service, n):
    return jax.tree_util.tree_map(lambda a: a[:n], service)


def _step_sizes(
    cfg: ExperimentConfig, nominal, policy: str, procs: Processes | None = None
) -> np.ndarray:
    """Every router's step size, `(scenarios, n)` (padded cells 0), by `cfg.step_rule`.

    `"paper"` (seed App. B: "inversely proportional to the mean network latency"):
    $\\eta_i = \\kappa_c/\\bar\\tau_i$ (`paper_step_sizes`). `"oracle"`: $\\eta = $
    `step_fraction` $\\cdot \\eta^*$ per scenario, from the linearisation at the nominal
    scenario's equilibrium (`_critical_step_sizes`), the same for all its routers; a scenario
    whose $\\eta^*$ cannot be computed takes the median of the others. In both, the nominal
    scenarios are the routers' view (`_variant_batch`).

    Oracle: every process solves the equilibria of the whole batch (one batched solve, as
    in a one-process run) and computes $\\eta^*$ for its share of the scenarios; all of
    them then take the median of all."""
    pol = policy_from_name(policy)
    n = max(int(np.asarray(s.cell_mask).sum()) for s in nominal)
    if cfg.step_rule == "paper":
        return paper_step_sizes(nominal, pol.cost.name, n)
    procs = Processes() if procs is None else procs
    batch = stack_scenarios(nominal)
    eq = solve_equilibrium(batch, pol.cost)
    part = procs.share(len(nominal))
    if len(part) != len(nominal):
        batch, eq = jax.tree_util.tree_map(lambda a: a[part.start : part.stop], (batch, eq))
    mine = _critical_step_sizes(batch, pol, eq)
    etas = [e for share in procs.allgather(mine, "experiment/eta") for e in share]
    good = [e for e in etas if e is not None and math.isfinite(e) and e > 0]
    fill = float(np.median(good)) if good else 1.0
    eta = cfg.step_fraction * np.array([fill if e is None else e for e in etas])
    mask = np.stack([padded(np.asarray(s.cell_mask), n) for s in nominal])
    return np.where(mask, eta[:, None], 0.0)


def _critical_step_sizes(batch, policy, eq) -> list[float | None]:
    """$\\eta^*$ of every scenario of `batch` around its equilibrium `eq` (no second
    solve), in one compiled call (`batch_critical_step_size`; theory/stability.md §7);
    `None` where the equilibrium failed. Where Newton's polish did not converge
    (`not_converged`) $\\eta^*$ is the middle of the bisected bracket, within 3.3%, which
    the oracle's fraction of it does not need to be closer than."""
    crit = batch_critical_step_size(batch, policy, eq)
    ok = eq.status_names() == "success"
    return [float(e) if good else None for e, good in zip(np.asarray(crit.critical_step_size), ok)]


# ----------------------------------------------------------------------------------------
# Resumable results file
# ----------------------------------------------------------------------------------------


def _read_rows(path: Path, columns: tuple[str, ...] = FIELDS) -> list[dict]:
    """The complete rows of `path` (`CsvRows.read`: a torn last line left out)."""
    return CsvRows(path, columns).read()


def _complete_units(rows: list[dict], expected: int) -> dict[tuple[str, str], list[dict]]:
    units: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        units.setdefault((r["variant"], r["policy"]), []).append(r)
    return {k: v for k, v in units.items() if len(v) == expected}


def _append(path: Path, rows: list[dict], columns: tuple[str, ...] = FIELDS) -> None:
    """Append `rows` to `path` durably (`CsvRows.append`)."""
    CsvRows(path, columns).append(rows)


# ----------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------


# The metric keys of every summary row, besides variant, policy, runs and failed (the
# JSON contract of docs/cli.md, *dlbfluid experiment*; `summarise` writes them).
SUMMARY_FIELDS = (
    "normalized_latency",
    "normalized_latency_p10",
    "normalized_latency_p50",
    "normalized_latency_p90",
    "mean_latency",
    "error_rate",
    "error_rate_p90",
)


def recovery_time(share, oracle, horizon: float, end: float = RECOVERY_SLOWDOWN[2]):
    """The time from the slowdown's end $t_r$ = `end` x `horizon` until the slowed cell's
    traffic share `share` `(S,)` (per interval of `horizon`/S) stays within
    `RECOVERY_TOLERANCE` of the oracle run's `oracle` (relative) to the horizon, in whole
    intervals: 0 when it never leaves it, None when the last interval is still outside
    (censored: the time exceeds $T - t_r - T/S$). An interval without deliveries (NaN) in
    either run counts as outside."""
    s, o = np.asarray(share, float), np.asarray(oracle, float)
    S = s.shape[0]
    dt = horizon / S
    k_r = int(round(end * horizon / dt))
    with np.errstate(invalid="ignore"):
        ok = np.abs(s - o) <= RECOVERY_TOLERANCE * o
    bad = np.flatnonzero(~ok[k_r:])
    if bad.size == 0:
        return 0.0
    last = k_r + int(bad[-1])
    return None if last == S - 1 else (last + 1) * dt - end * horizon


def _recovery_summary(mine: list[dict], oracle: dict, horizon: float) -> dict | None:
    """The `recovery_time` object of one (variant, policy): its runs paired with the oracle
    variant's (same policy, scenario, trial), recovered or censored (module docstring of
    `recovery_time`); quantiles of the censored runs are bounds, reported as null."""
    times, paired = [], 0
    for r in mine:
        ref = oracle.get((r["policy"], r["scenario"], r["trial"]))
        if ref is None or r["status"] != "success" or ref["status"] != "success":
            continue
        paired += 1
        share = [float(x) for x in r["slowed_share"].split()]
        base = [float(x) for x in ref["slowed_share"].split()]
        t = recovery_time(share, base, horizon)
        times.append(math.inf if t is None else t)
    if not paired:
        return None
    S = len(mine[0]["slowed_share"].split())
    bound = horizon * (1.0 - RECOVERY_SLOWDOWN[2]) - horizon / S
    finite = [t for t in times if math.isfinite(t)]

    def q(p):
        v = float(np.percentile(times, p, method="inverted_cdf"))
        return v if math.isfinite(v) else None

    return {
        "runs": paired,
        "recovered": len(finite),
        "censored": paired - len(finite),
        "censored_above_s": bound,
        "mean_recovered_s": float(np.mean(finite)) if finite else None,
        "p50_s": q(50),
        "p90_s": q(90),
    }


def summarise(
    rows: list[dict], policies=POLICIES, model: str = "fluid", horizon: float | None = None
) -> list[dict]:
    """Per `(variant, policy)`: mean latency normalised by Rand's on the same scenario and
    trial, its mean and 10/50/90th percentiles across scenarios x trials, the raw mean
    latency and the error rate (mean and 90th percentile). Failed runs are counted, not
    averaged. Every row also holds `model` and `p90`: null for the fluid model, which has
    no latency distribution.

    `model="requests"` (rows with `REQUEST_FIELDS`): the latencies and error rates are the
    request-level runs'; `p90` is the mean across scenarios x trials of the run's 90th
    percentile latency over Rand's on the same scenario and trial, `p90_latency` its raw
    mean (s), and `fluid_normalized_latency`, `fluid_mean_latency`, `fluid_error_rate` the
    fluid model's on the same scenarios (over the runs where both Rand's and the policy's
    fluid runs succeeded). Rows with `ESTIMATION_FIELDS` (online estimation) add
    `estimation`: the runs counted, the 50th and 90th percentiles and the maximum of each
    run's oldest model (s), the runs with a stale cell (a model at least a window old) and
    the mean number of stale cells per run. Rows with `slowed_share` (the `recovery`
    kind, `horizon` given) add `recovery_time` to each variant but `oracle`
    (`_recovery_summary`: runs paired with the oracle variant's, recovered, censored with
    their bound, the mean of the recovered, p50 and p90 with censored runs counted as
    infinite, null where the quantile is censored); the oracle variant's is null. Rows with
    `AFFINITY_FIELDS` add `sessions`: the runs counted (those that succeeded beside Rand's),
    the mean and 10th percentile of the cache hit rate, the mean and 90th percentile of the
    busiest server's share, the mean session move rate."""
    by = {}
    for r in rows:
        by[(r["variant"], r["policy"], r["scenario"], r["trial"])] = r
    oracle = {(p, s, t): r for (v, p, s, t), r in by.items() if v == "oracle"}
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    out = []
    for v in variants:
        for p in policies:
            mine = [r for r in rows if r["variant"] == v and r["policy"] == p]
            if not mine:
                continue
            norm, lat, err, failed = [], [], [], 0
            p90n, p90, fnorm, flat, ferr = [], [], [], [], []
            ages, stale, hits, busiest, moves = [], [], [], [], []
            for r in mine:
                base = by.get((v, "rand", r["scenario"], r["trial"]))
                if model == "requests" and base is not None:
                    if r["fluid_status"] == "success" == base["fluid_status"]:
                        flat.append(float(r["fluid_mean_latency"]))
                        ferr.append(float(r["fluid_error_rate"]))
                        fnorm.append(flat[-1] / float(base["fluid_mean_latency"]))
                if r["status"] != "success" or base is None or base["status"] != "success":
                    failed += 1
                    continue
                lat.append(float(r["mean_latency"]))
                err.append(float(r["error_rate"]))
                norm.append(float(r["mean_latency"]) / float(base["mean_latency"]))
                if model == "requests":
                    p90.append(float(r["p90_latency"]))
                    p90n.append(p90[-1] / float(base["p90_latency"]))
                if r.get("estimate_age_max", "") != "":
                    ages.append(float(r["estimate_age_max"]))
                    stale.append(int(r["estimate_stale_cells"]))
                if r.get("cache_hit_rate", "") != "":
                    hits.append(float(r["cache_hit_rate"]))
                    busiest.append(float(r["busiest_server_share"]))
                    moves.append(float(r["session_move_rate"]))
            q = lambda a, pct: float(np.percentile(a, pct)) if a else None  # noqa: E731
            m = lambda a: float(np.mean(a)) if a else None  # noqa: E731
            extra: dict = {"p90": None, "model": model}
            if model == "requests":
                extra = {
                    "p90": m(p90n),
                    "p90_latency": m(p90),
                    "fluid_normalized_latency": m(fnorm),
                    "fluid_mean_latency": m(flat),
                    "fluid_error_rate": m(ferr),
                    "model": model,
                }
            if horizon is not None and mine and "slowed_share" in mine[0]:
                extra["recovery_time"] = (
                    None if v == "oracle" else _recovery_summary(mine, oracle, horizon)
                )
            if mine and "cache_hit_rate" in mine[0]:
                extra["sessions"] = {
                    "runs": len(hits),
                    "cache_hit_rate": m(hits),
                    "cache_hit_rate_p10": q(hits, 10),
                    "busiest_server_share": m(busiest),
                    "busiest_server_share_p90": q(busiest, 90),
                    "session_move_rate": m(moves),
                }
            if ages:
                extra["estimation"] = {
                    "runs": len(ages),
                    "age_max_p50": q(ages, 50),
                    "age_max_p90": q(ages, 90),
                    "age_max": float(np.max(ages)),
                    "stale_runs": int(np.sum(np.asarray(stale) > 0)),
                    "stale_cells_mean": m(stale),
                }
            out.append(
                {
                    "variant": v,
                    "policy": p,
                    "runs": len(mine),
                    "failed": failed,
                    "normalized_latency": float(np.mean(norm)) if norm else None,
                    "normalized_latency_p10": q(norm, 10),
                    "normalized_latency_p50": q(norm, 50),
                    "normalized_latency_p90": q(norm, 90),
                    "mean_latency": float(np.mean(lat)) if lat else None,
                    "error_rate": float(np.mean(err)) if err else None,
                    "error_rate_p90": q(err, 90),
                    **extra,
                }
            )
    return out


# ----------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------


def run_experiment(
    config: ExperimentConfig,
    out_dir,
    *,
    progress: bool = False,
    processes: Processes | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict | None:
    """Run (or resume) an experiment into `out_dir`; returns the summary.

    Files: `config.json` (the `ExperimentConfig`; a different one in the same directory is
    an error), `results.csv` (one row per variant, policy, scenario and trial; columns
    `FIELDS`), `summary.csv` and `summary.json` (`summarise`), `<experiment>.png`
    (`plot_summary`).

    `processes`: the processes sharing the run (`dlbfluid._runtime.distributed`, the command
    line's `--coordinator`...; default this one alone). Every process calls
    `run_experiment` with the same arguments and simulates its contiguous share of the
    scenarios (all their trials) of every `(variant, policy)` batch; the batch-wide
    choices (the integrator's sub-steps, the median step size) are made on the whole
    batch. Process 0 alone reads and writes `out_dir`, appending each batch's rows in a
    one-process run's order, shows progress and returns the summary (the others return
    `None`).

    `labels`: another name of each field (and of `"out_dir"`) in the directory's
    refusals (the command line's options, from `dlbfluid._cli._flags`); by default the
    fields' own names (`out_dir = '...' is invalid: ... (changed: seed: 0 -> 1)`).

    **Raises:** `X64Error` while JAX's x64 mode is off (the experiment computes in
    float64), before anything is written.
    """
    require_x64("run_experiment")
    cfg = config
    procs = Processes() if processes is None else processes
    out = Path(out_dir)
    results = CsvRows(out / "results.csv", fields(cfg))
    sweep: Sweep[tuple] = Sweep(
        procs, "experiment/start", "experiment/rows", results if procs.main else None
    )
    _, done = sweep.open(lambda: (None, [list(unit) for unit in _open_results(cfg, out, labels)]))
    finished = {tuple(unit) for unit in done}
    order = ["rand"] + [p for p in cfg.policies if p != "rand"]
    units = [(v, o, p) for v, o in cfg.run_variants() for p in order]
    bar = Progress("experiment", len(units), enabled=progress and procs.main, unit="units")
    ndone = [sum((v, p) in finished for v, _, p in units)]
    bar.update(ndone[0], start=ndone[0])
    cache: dict = {}

    def batch_of(v: str, opts: dict):
        # (the variants' units are consecutive: one batch at a time)
        if cache.get("variant") != v:
            cache.clear()
            cache.update(variant=v, batch=_variant_batch(cfg, opts))
        return cache["batch"]

    def compute(unit, _position) -> list[dict]:
        shown = lambda: bar.update(ndone[0], f"{unit[0]} {unit[2]}")  # noqa: E731
        return _unit_rows(cfg, unit, batch_of(unit[0], unit[1]), procs, shown)

    def stored(batch, _rows) -> None:
        ndone[0] += 1
        bar.update(ndone[0], f"{batch[-1][0]} {batch[-1][2]}")

    todo = [(v, o, p) for v, o, p in units if (v, p) not in finished]
    sweep.run(todo, compute, stored, whole_units=False)
    if not procs.main:
        return None
    return _finish(cfg, out, results, order)


def _finish(cfg: ExperimentConfig, out: Path, results: CsvRows, order: list[str]) -> dict:
    """Write `summary.csv`, `summary.json` and the plot from `results`; the summary."""
    summary = summarise(results.read(), order, cfg.model, cfg.horizon)
    # (summary.csv flattens a nested object: `estimation.age_max` -> `estimation_age_max`)
    flat = [
        {
            f"{k}_{kk}" if isinstance(v, dict) else k: vv
            for k, v in row.items()
            for kk, vv in (v.items() if isinstance(v, dict) else [(None, v)])
        }
        for row in summary
    ]
    with open(out / "summary.csv", "w", newline="") as f:
        if flat:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in flat for k in row)))
            w.writeheader()
            w.writerows(flat)
    result = {"experiment": cfg.experiment, "config": cfg.to_json(), "summary": summary}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    level = f" (request level, {cfg.service})" if cfg.model == "requests" else ""
    plot_summary(
        summary,
        out / f"{cfg.experiment}.png",
        title=f"dlbfluid experiment "
        f"{cfg.experiment}{level}: {cfg.scenarios} scenario{'s' * (cfg.scenarios != 1)} x "
        f"{cfg.trials} trial{'s' * (cfg.trials != 1)}",
    )
    return result


# ----------------------------------------------------------------------------------------
# One unit: a (variant, policy) batch
# ----------------------------------------------------------------------------------------


def _unit_policy(cfg: ExperimentConfig, name: str):
    """`(policy, error aversion or None)` of a unit. The paper's MNLB is a separate,
    centralised system: no DLB error aversion unless asked (`mnlb_error_aversion`)."""
    aversion = ErrorAversion() if cfg.error_aversion else None
    pol = policy_from_name(name)
    if isinstance(pol, MNLB):
        pol = MNLB(update_period=cfg.mnlb_period, utilisation_cap=cfg.mnlb_cap)
        return pol, aversion if cfg.mnlb_error_aversion else None
    return pol, aversion


def _unit_rows(cfg: ExperimentConfig, unit, variant_batch, procs: Processes, shown) -> list:
    """This process's rows of `unit = (variant, options, policy)`: its share of the
    scenarios (all their trials) simulated (`_simulate_unit`, and `_simulate_requests_unit`
    at request level) on the variant's batch `variant_batch` (`_variant_batch`), with the
    batch-wide choices (sub-steps, the median step size) made on the whole batch. `shown()`
    reports the unit as started."""
    v, opts, p = unit
    nominal, batch, util = variant_batch
    pol, averse = _unit_policy(cfg, p)
    tick = opts.get("tick", cfg.tick)
    flow = isinstance(pol, FlowRouting)
    n_max = batch.n_cells
    if flow:
        eta_s = _step_sizes(cfg, nominal, p, procs)
        eta_s = np.pad(eta_s, ((0, 0), (0, n_max - eta_s.shape[1])))
    else:
        eta_s = np.ones((cfg.scenarios, n_max))
    eta = np.repeat(eta_s, cfg.trials, axis=0)
    # (the results file's step size: the mean over a scenario's routers)
    masks = np.asarray(batch.cell_mask)
    eta_mean = (eta * masks).sum(axis=1) / masks.sum(axis=1)
    shown()
    part = procs.share(cfg.scenarios)
    lo, hi = part.start * cfg.trials, part.stop * cfg.trials
    if lo == hi:
        return []
    # The sub-steps are chosen for the whole batch, as a one-process run does.
    integrator = Fast().for_batch(batch, tick)
    whole = (lo, hi) == (0, cfg.scenarios * cfg.trials)
    mine = batch if whole else jax.tree_util.tree_map(lambda a: a[lo:hi], batch)
    sol = _simulate_unit(cfg, mine, pol, eta[lo:hi], averse, integrator, tick)
    runs = {
        "lat": np.asarray(sol.mean_latency(window=1.0)),
        "err": np.asarray(sol.error_rate(window=1.0)),
        "status": sol.status_names(),
    }
    if cfg.model == "requests":
        fluid = {f"f_{k}": a for k, a in runs.items()}
        lat, p90, err, status, est = _simulate_requests_unit(
            cfg, mine, pol, eta[lo:hi], averse, tick, opts
        )
        runs = {"lat": lat, "p90": p90, "err": err, "status": status, **est, **fluid}
    n_cells = masks.sum(axis=-1)
    common = {"experiment": cfg.experiment, "variant": v, "policy": p}
    return [
        _row(cfg, common, divmod(k, cfg.trials), {key: a[b] for key, a in runs.items()},
             int(n_cells[k]), util, f"{eta_mean[k]:.6g}" if flow else "")
        for b, k in enumerate(range(lo, hi))
    ]  # fmt: skip


def _row(cfg: ExperimentConfig, common: dict, st, run: dict, n_cells: int, util, step) -> dict:
    """One `results.csv` row: scenario and trial `st`, its run's numbers `run` (`lat`,
    `err`, `status`; at request level also `p90` and the fluid run's `f_lat`, `f_err`,
    `f_status`)."""
    s, t = st
    # A "success" with a non-finite latency (e.g. nothing served) is reported as such.
    ok_lat = run["status"] != "success" or math.isfinite(run["lat"])
    state = run["status"] if ok_lat else "nonfinite"
    ok = state == "success"
    extra = {}
    if cfg.model == "requests":
        f_state = run["f_status"] if math.isfinite(run["f_lat"]) else "nonfinite"
        f_ok = f_state == "success"
        extra = {
            "p90_latency": f"{run['p90']:.10g}" if ok else "",
            "fluid_mean_latency": f"{run['f_lat']:.10g}" if f_ok else "",
            "fluid_error_rate": f"{run['f_err']:.10g}" if f_ok else "",
            "fluid_status": f_state,
        }
        if "age_max" in run:
            extra.update(
                estimate_age_max=f"{run['age_max']:.10g}",
                estimate_samples_min=str(int(run["samples_min"])),
                estimate_stale_cells=str(int(run["stale"])),
            )
        elif cfg.experiment == "recovery":
            extra.update(estimate_age_max="", estimate_samples_min="", estimate_stale_cells="")
        if "hits" in run:
            extra.update(
                cache_hit_rate=f"{run['hits']:.10g}" if ok else "",
                busiest_server_share=f"{run['busiest']:.10g}" if ok else "",
                session_move_rate=f"{run['moves']:.10g}" if ok else "",
            )
        if "share" in run:
            extra.update(
                slowed_cell=str(int(run["slowed"])),
                slowed_share=" ".join(f"{x:.6g}" for x in run["share"]),
            )
    return {
        **common,
        "scenario": s,
        "trial": t,
        "n_cells": n_cells,
        "utilisation": f"{util[s]:.6g}",
        "step_size": step,
        "mean_latency": f"{run['lat']:.10g}" if ok else "",
        "error_rate": f"{run['err']:.10g}" if ok else "",
        "status": state,
        **extra,
    }


def _open_results(
    cfg: ExperimentConfig, out: Path, labels: Mapping[str, str] | None = None
) -> dict[tuple[str, str], list[dict]]:
    """Create or check `out` (`manifest.json`, `config.json`), drop a torn unit from
    `results.csv`, and return the complete units already there.

    The manifest (`dlbfluid._runtime.manifest`) holds `cfg.to_json()` and the package version: a
    different configuration or version is refused (`ValueError` naming each changed
    field). A directory of a version without manifests holds `config.json` alone: it is
    checked against `cfg` and, when equal, adopted (its version was not recorded) by
    writing the manifest, so those directories keep resuming. `config.json` is still
    written (summary readers and older versions read it). `labels`: another name of each
    field (and of `"out_dir"`) in the refusals, e.g. the command line's options.
    """
    labels = {} if labels is None else labels
    flag = labels.get("out_dir", "out_dir")
    cpath = out / "config.json"
    legacy = None
    if not (out / MANIFEST).exists() and cpath.exists():
        try:
            legacy = json.loads(cpath.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{flag} = {str(out)!r} is invalid: its config.json is not an experiment's "
                f"configuration ({e}); choose a new {flag}"
            ) from None
        if not isinstance(legacy, dict):
            legacy = {"config.json": legacy}  # (reported as a change of every field)
    resumed = open_manifest(
        out, "experiment", cfg.to_json(), flag=flag, labels=labels, adopt=legacy,
        results=("results.csv",),
    )  # fmt: skip
    if not cpath.exists():
        cpath.write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    results = CsvRows(out / "results.csv", fields(cfg))
    rows = results.read()
    done = _complete_units(rows, cfg.scenarios * cfg.trials)
    kept = [r for unit in done.values() for r in unit]
    if len(kept) != len(rows) or results.torn() or not results.path.exists():
        results.rewrite(kept)  # drop a torn unit (and write the header of a new file)
    if resumed:
        total = len(cfg.run_variants()) * len(cfg.policies)
        resume_note(out, len(done), total, "units")
    return done


def _simulate_unit(cfg, batch, pol, eta, aversion, integrator, tick):
    return simulate(
        batch,
        pol,
        step_size=eta,
        tick=tick,
        horizon=cfg.horizon,
        n_save=10,
        integrator=integrator,
        error_aversion=aversion,
        throw=False,
    )


def online_estimation(cfg: ExperimentConfig, variant: dict | None = None):
    """The `OnlineEstimation` of a configuration's runs (None for the oracle), or of a
    variant's `estimation` options `variant` (the `recovery` kind's online variants),
    with the configuration's refit period and window (`ExperimentConfig.mitigations`)."""
    if variant is None and cfg.estimation == "oracle":
        return None
    return OnlineEstimation(
        refit_period=cfg.refit_period, window=cfg.estimation_window, **cfg.mitigations(variant)
    )


def _simulate_requests_unit(cfg, batch, pol, eta, aversion, tick, options=None):
    """The request-level runs of one unit: one trial per scenario and fluctuation trial of
    `batch`, the policy wrapped in `ErrorAverse` as the fluid run's is, seeded by
    `cfg.seed` (the same random streams for every policy: common random numbers). Returns
    per run the mean latency of the served requests (NaN when none was served), the 90th
    percentile latency, the error rate, the status name and, with online estimation, the
    `ESTIMATION_FIELDS`' numbers over the real cells (`age_max`, `samples_min`, `stale`; an
    empty dict for the oracle). A variant's `options` may set the estimation (`recovery`);
    with a `slowdown` the runs also give `slowed` (the slowed cell) and `share`, its
    share of the deliveries per `RECOVERY_SAVE` seconds (`RECOVERY_FIELDS`); with an
    `affinity` `hits` and `busiest` (`AFFINITY_FIELDS`).

    Across processes each process draws its share's streams from `cfg.seed` alone: the
    runs are statistically, not bitwise, those of a one-process run."""
    looped = pol if aversion is None else ErrorAverse(pol, aversion)
    options = {} if options is None else options
    estimation = online_estimation(cfg, options.get("estimation")) or "oracle"
    slowed = "slowdown" in options
    sol = simulate_requests(
        batch,
        looped,
        service=cfg.service,
        scale=cfg.scale,
        probe_smoothing=cfg.probe_smoothing,
        leaf=PowerOfD(cfg.pod_d) if cfg.leaf == "pod" else "jsq",
        estimation=estimation,
        affinity=options.get("affinity", "off"),
        seed=cfg.seed,
        step_size=eta,
        tick=tick,
        horizon=cfg.horizon,
        n_save=max(1, round(cfg.horizon / RECOVERY_SAVE)) if slowed else 1,
        throw=False,
    )
    served = np.asarray(sol.served)[:, 0]
    total = np.asarray(sol.latency_sum)[:, 0]
    lat = np.where(served > 0, total / np.maximum(served, 1), np.nan)
    p90 = np.asarray(sol.percentile(0.9))[:, 0]
    p90 = np.where(served > 0, p90, np.nan)
    err = np.asarray(sol.error_rate())[:, 0]
    status = np.asarray(sol.status_names())[:, 0]
    status = np.where((status == "success") & ~np.isfinite(p90), "nonfinite", status)
    est = {}
    if sol.estimation is not None:
        real = np.asarray(sol.cell_mask)  # (B, n)
        age = np.asarray(sol.estimation.age)[:, 0]
        samples = np.asarray(sol.estimation.samples)[:, 0]
        est = {
            "age_max": np.max(np.where(real, age, -np.inf), axis=-1),
            "samples_min": np.min(np.where(real, samples, np.iinfo(np.int32).max), axis=-1),
            "stale": np.sum(real & (age >= cfg.estimation_window), axis=-1),
        }
    if sol.cache_hit_rate is not None and sol.busiest_server_share is not None:
        assert sol.session_move_rate is not None
        est["hits"] = np.asarray(sol.cache_hit_rate)[:, 0]
        est["busiest"] = np.asarray(sol.busiest_server_share)[:, 0]
        est["moves"] = np.asarray(sol.session_move_rate)[:, 0]
    if slowed:
        factors = np.asarray(batch.slowdown_factors)  # (B, n, entries)
        cell = np.argmax(np.max(factors, axis=-1), axis=-1)
        share = sol.traffic_share()[:, 0]  # (B, intervals, n)
        est["slowed"] = cell
        est["share"] = np.take_along_axis(share, cell[:, None, None], axis=-1)[..., 0]
    return lat, p90, err, status, est
