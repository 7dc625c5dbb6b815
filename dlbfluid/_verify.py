"""Batch verification of Theorem 1 over random scenarios (theory/lyapunov.md, *Batch*).

For every scenario: solve the RIF, Wardrop and social-optimum equilibria, compute every
flow policy's critical step size for the whole chunk at once (`batch_critical_step_size`),
simulate flow-rif, flow-lat and flow-grad, and record the integrated drift certificate
(`dlbfluid._theorem1`), the time-average distance $\\frac1T\\int_0^T\\sum_jD_j$, the final
distance to $N^*$ and the step size relative to the critical one; with `ladder="full"`
also the Theorem-1 ladder (the bound's constants, the $T^{-1/2}$ schedule, $G_1$ against
the delays, the empirical $\\eta_0$). Results are appended to a JSON-lines file chunk by
chunk, so that a killed run resumes where it stopped without losing or duplicating a
scenario; the directory's manifest (`dlbfluid._manifest`) refuses a rerun with other
settings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._defaults import STEP_BASES, STEP_RULES, VERIFY_GENERATORS, VERIFY_LADDERS
from ._distributed import Processes
from ._equilibrium import solve_equilibrium
from ._experiment_config import STEP_RULE_KAPPA
from ._generator import generate, scenario_dicts
from ._global_threshold import WorstCaseSearch, global_threshold
from ._manifest import open_manifest, resume_note
from ._policies import FlowRouting, policy_from_name
from ._progress import Progress
from ._registry import flow_policy_names
from ._scenario import check_capacity, scenario_from_dict, stack_scenarios
from ._simulate import simulate
from ._stability import batch_critical_step_size, scale_delays
from ._step_rule import paper_step_sizes
from ._theorem1 import (
    Ladder,
    batch_projection_check,
    batch_start_terms,
    batch_theorem1_check,
    batch_theorem1_constants,
    theorem1_ladder,
)
from ._theorem1.check import theorem1_record


def flow_policies(names=None) -> tuple[tuple[str, str], ...]:
    """`(policy name, cost name)` of the registered flow policies (or of `names`)."""
    out = []
    for p in flow_policy_names() if names is None else names:
        pol = policy_from_name(p)
        if not isinstance(pol, FlowRouting):
            raise ValueError(
                f"policy = {p!r} is invalid: allowed flow policies are {list(flow_policy_names())}"
            )
        out.append((p, pol.cost.name))
    return tuple(out)


def random_network(
    rng: np.random.Generator,
    n: int,
    *,
    load: tuple[float, float] = (0.4, 0.85),
    residency: float = 0.15,
    max_latency: float = 0.15,
) -> dict:
    """A random scenario that satisfies Assumptions 1-3 (theory/lyapunov.md, *Generator*).

    * cells on the unit square; one-way latency $\\tau_{ij} = $ `max_latency` $\\times$
      distance$/\\sqrt2$, $\\tau_{ii} = 0$;
    * capacities $\\bar\\mu_j \\sim$ LogNormal(log 4, 0.4); half the cells M/M/1, half softplus
      with $L_0 \\sim U[0.5, 1.5]$, knee $N_0 = u L_0\\bar\\mu$, $u \\sim U[0.1, 0.8]$ (so
      $a_0 = L_0(1-u) > 0$: Assumptions 1 and 3 for all three costs), width $\\sim U[0.3, 2]$;
    * replicas $\\sim$ 1 + Poisson(3);
    * each off-diagonal arc is removed with probability `residency` (self-arcs stay, so
      every cell keeps an in-neighbour and an allowed arc);
    * total demand $\\rho\\sum_j\\bar\\mu_j$ with $\\rho \\sim U[\\text{load}]$, split by a
      Dirichlet(1) draw; redrawn until Assumption 2 (strict feasibility) holds.
    """
    pos = rng.random((n, 2))
    dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1) / math.sqrt(2.0)
    tau = max_latency * dist
    keep = (rng.random((n, n)) >= residency) | np.eye(n, dtype=bool)
    caps = np.exp(rng.normal(math.log(4.0), 0.4, n))
    cells = []
    for j in range(n):
        if j % 2 == 0:
            svc = {"model": "mm1", "capacity": float(caps[j])}
        else:
            L0 = rng.uniform(0.5, 1.5)
            svc = {
                "model": "softplus",
                "base_latency": L0,
                "capacity": float(caps[j]),
                "knee": rng.uniform(0.1, 0.8) * L0 * caps[j],
                "width": rng.uniform(0.3, 2.0),
            }
        cells.append(
            {
                "name": f"c{j}",
                "replicas": int(1 + rng.poisson(3)),
                "service": svc,
                "arrival_rate": 0.0,
            }
        )
    latency = [[float(tau[i, j]) if keep[i, j] else None for j in range(n)] for i in range(n)]
    for _ in range(100):
        rho = rng.uniform(*load)
        lam = rho * caps.sum() * rng.dirichlet(np.ones(n))
        for j in range(n):
            cells[j]["arrival_rate"] = float(lam[j])
        d: dict = {"name": f"random-{n}", "cells": cells, "latency": latency}
        try:
            check_capacity(scenario_from_dict(d, allow_overload=True))
            d["utilisation"] = float(rho)
            return d
        except ValueError:
            continue
    raise RuntimeError("could not draw a feasible demand split in 100 tries")  # pragma: no cover


def draw_scenario(seed: int, index: int, *, n_cells=(2, 6), **kwargs) -> dict:
    """Scenario `index` of the stream `seed`: independent of chunking and of resumption."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(n_cells[0], n_cells[1] + 1))
    d = random_network(rng, n, **kwargs)
    d["index"] = index
    return d


def draw_appb(seed: int, index: int, *, n_cells=(2, 6)) -> dict:
    """Scenario `index` of the App.-B generator's stream `seed` (`dlbfluid.generate`,
    theory/generator.md) as Theorem 1 takes it: constant demand (no event, no
    fluctuation) and unbounded queues (the seed's finite buffers drop flow, which the
    fluid model of the theorem does not)."""
    return draw_appb_many(seed, [index], n_cells=n_cells)[0]


def draw_appb_many(seed: int, indices, *, n_cells=(2, 6)) -> list[dict]:
    """`draw_appb` for several indices, one `generate` call per contiguous run of them
    (each call compiles nothing new and costs about as much as one scenario)."""
    indices = [int(i) for i in indices]
    out: dict[int, dict] = {}
    k = 0
    while k < len(indices):
        j = k
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        gen = generate(seed, j - k + 1, min_cells=n_cells[0], max_cells=n_cells[1],
                       start=indices[k])  # fmt: skip
        for i, d in zip(indices[k : j + 1], scenario_dicts(gen, horizon=1.0, fluctuation=0.0)):
            for cell in d["cells"]:
                cell.pop("buffer", None)
            d["index"] = i
            out[i] = d
        k = j + 1
    return [out[i] for i in indices]


class _AppB:
    """The App.-B source of `verify`: `draw_appb` per index, `many` per chunk."""

    def __init__(self, n_cells):
        self.n_cells = n_cells

    def __call__(self, seed: int, index: int) -> dict:
        return draw_appb(seed, index, n_cells=self.n_cells)

    def many(self, seed: int, indices) -> list[dict]:
        return draw_appb_many(seed, indices, n_cells=self.n_cells)


def _read_done(path: Path) -> dict[int, dict]:
    """Records already written; a torn last line (killed mid-write) is dropped."""
    done: dict[int, dict] = {}
    if not path.exists():
        return done
    lines = path.read_text().splitlines()
    good = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "index" in rec and rec["index"] not in done:
            done[rec["index"]] = rec
            good.append(line)
    if len(good) != len(lines):  # rewrite without the torn or duplicated lines
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in good))
        os.replace(tmp, path)
    return done


def _quantiles(v) -> dict:
    v = np.asarray([x for x in v if x is not None and math.isfinite(x)], float)
    if v.size == 0:
        return {"q10": None, "q50": None, "q90": None, "max": None}
    q = np.quantile(v, [0.1, 0.5, 0.9])
    return {"q10": float(q[0]), "q50": float(q[1]), "q90": float(q[2]), "max": float(v.max())}


def _fraction(v) -> float | None:
    v = [x for x in v if x is not None]
    return float(np.mean(v)) if v else None


def summarise(records: list[dict]) -> dict:
    """Per policy: Theorem 1's verdict first (the fraction of runs inside its hypothesis,
    the fraction of those under the explicit bound, the tightness bound / measured, each
    estimate's holds fraction), the three step-size thresholds, then the diagnostics
    (converged, the projection check, the descriptive fit; null where a record lacks
    them, e.g. without the ladder)."""
    out: dict = {"scenarios": len(records), "policies": {}}
    names = list(dict.fromkeys(p for r in records for p in r["policies"]))
    for pol in names:
        rs = [r["policies"][pol] for r in records]
        thm = [r.get("theorem1") or {} for r in rs]
        thr = [r.get("thresholds") or {} for r in rs]
        proj = [r.get("projection_check") or {} for r in rs]
        bound = [r.get("bound") or {} for r in rs]
        inside = [t for t in thm if t.get("in_hypothesis")]
        estimates = {k for t in thm for k in (t.get("estimates") or {})}
        out["policies"][pol] = {
            "in_hypothesis_fraction": _fraction([t.get("in_hypothesis") for t in thm]),
            "theorem1_holds_fraction": _fraction([t.get("holds") for t in inside]),
            "tightness": _quantiles([t.get("tightness") for t in inside]),
            "estimates_hold_fraction": {
                k: _fraction([(t.get("estimates") or {}).get(k, {}).get("holds") for t in thm])
                for k in sorted(estimates)
            },
            "eta0_over_eta_star": _quantiles(
                [_ratio(t.get("eta0"), t.get("eta_star")) for t in thr]
            ),  # fmt: skip
            "eta_global_over_eta_star": _quantiles(
                [_ratio(t.get("eta_global"), t.get("eta_star")) for t in thr]
            ),
            "bistable_fraction": _fraction([t.get("bistable") for t in thr]),
            "converged_fraction": float(np.mean([r["converged"] for r in rs])) if rs else None,
            "failed": int(sum(r["status"] != "success" for r in rs)),
            "time_average_distance": _quantiles([r["time_average_distance"] for r in rs]),
            "final_distance": _quantiles([r["final_distance"] for r in rs]),
            "eta_over_eta_star": _quantiles([r["eta_over_eta_star"] for r in rs]),
            "projection_check_holds_fraction": _fraction([c.get("holds") for c in proj]),
            "discretisation_excess": _quantiles([c.get("discretisation_excess") for c in proj]),
            "bound_holds_fraction": _fraction([b.get("holds") for b in bound]),
            "A": _quantiles([b.get("A") for b in bound]),
            "B": _quantiles([b.get("B") for b in bound]),
            "C": _quantiles([b.get("C") for b in bound]),
            "fit_rel_rms": _quantiles([b.get("fit_rel_rms") for b in bound]),
            "schedule_slope": _quantiles([r.get("schedule_slope") for r in rs]),
            "g1_growth_exponent": _quantiles([r.get("g1_growth_exponent") for r in rs]),
            "empirical_eta0_over_eta_star": _quantiles(
                [r.get("empirical_eta0_over_eta_star") for r in rs]
            ),
        }
    return out


def _ratio(a, b) -> float | None:
    return None if a is None or b is None or not b else float(a) / float(b)


def verify(
    n_scenarios: int,
    seed: int = 0,
    *,
    out_dir: str | Path | None = None,
    chunk: int | None = None,
    n_cells: tuple[int, int] = (2, 6),
    horizon: float = 200.0,
    tick: float = 0.05,
    step_fraction: float = 0.3,
    conv_tol: float = 1e-3,
    nodes: int = 8,
    progress: bool | Callable = False,
    policies=None,
    draw: Callable[[int, int], dict] | None = None,
    processes: Processes | None = None,
    generator: str = "random",
    scenario: dict | None = None,
    step_rule: str = "oracle",
    ladder: str = "none",
    tau_scales: tuple[float, ...] = (1.0, 2.0, 4.0),
    step_base: str = "eta-star",
    worst_case: bool = False,
    starts: int = 16,
) -> dict | None:
    """Verify Theorem 1 on `n_scenarios` random scenarios; returns the summary dict.

    `policies`: the flow policies to run (default: every registered one). `draw`: a
    scenario source `draw(seed, index) -> dict` in the scenario-file format (default
    `draw_scenario` with `n_cells`), e.g. networks of a user's own service model; scenario
    `index` must depend on `(seed, index)` only, so that a resumed run redraws what it lost.

    Each flow policy runs with $\\eta = $ `step_fraction` $\\times\\,\\eta^*$, its critical
    step size from the pseudospectral stability analysis (`critical_step_size`), so
    $\\eta/\\eta^* = $ `step_fraction` unless $\\eta^*$ is unavailable (then $\\eta = 0.05$ and
    the ratio is null). A scenario has converged when
    $\\max_j|N_j(T)-N_j^*| \\le$ `conv_tol` $\\max(1, \\max_j N_j^*)$ and its run succeeded.

    `generator`: the scenario source when `draw` is not given: `"random"` (`draw_scenario`,
    with `n_cells`) or `"appb"` (the App.-B generator, `draw_appb`). `scenario`: verify this
    one scenario dict (scenario-file format) instead; `n_scenarios` must then be 1.

    `step_rule`: `"oracle"` ($\\eta = $ `step_fraction` $\\times\\,\\eta^*$) or `"paper"`
    (router $i$ takes $\\eta_i = \\kappa_c/\\bar\\tau_i$, `dlbfluid._experiment.paper_step_sizes`;
    $\\eta^*$ is then the critical scaling of that profile, so `eta_over_eta_star` is how far
    below it the rule runs, and `step_size` is the largest router step).

    `ladder`: `"none"` (the run above and its certificate only) or `"full"`: the Theorem-1
    ladder of `dlbfluid._theorem1.theorem1_ladder` per scenario and policy (the bound's
    constants, the $T^{-1/2}$ schedule's slope, $G_1$ against the delay scales
    `tau_scales`, the empirical $\\eta_0$), about thirty further runs per scenario and
    policy, batched.

    `step_base`: what `step_fraction` multiplies with the oracle rule: `"eta-star"` (the
    linear critical step) or `"eta0"` (the proof's threshold, `batch_theorem1_constants`;
    a fraction $\\le 1$ runs inside Theorem 1's hypothesis). Every record carries Theorem 1's
    explicit constants and its check along the run (`theorem1`, theory/lyapunov.md) and the
    three thresholds (`thresholds`).

    `worst_case`: also search each scenario's global threshold $\\eta_g$ with `starts`
    starts per scenario and rung (`dlbfluid._global_threshold.global_threshold`, one batch
    per chunk and policy; its own horizon and tick, `WorstCaseSearch`'s defaults), filling
    `thresholds`' `eta_global`, `bistable`, `hopf`, `witness`, `cycle_amplitude` and
    `cycle_period` (null without it).

    `nodes`: the Chebyshev nodes of the former per-scenario critical step sizes, kept in
    the manifest only: `batch_critical_step_size` solves the exact characteristic
    equation (theory/stability.md §7).

    `processes`: the processes sharing the run (`dlbfluid._distributed`, the command
    line's `--coordinator`...; default this one alone). Every process calls `verify` with
    the same arguments and computes whole chunks; process 0 alone reads and writes
    `out_dir`, shows progress and returns the summary (the others return `None`), equal
    to a one-process run's.

    `out_dir`: where the records are appended (`results.jsonl`, chunk by chunk) and the
    summary written (`summary.json`); a rerun with the same `out_dir` resumes, computing
    only the scenarios not yet there. The directory's manifest (`dlbfluid._manifest`,
    `manifest.json`) records every argument that changes a number (`n_scenarios`,
    `seed`, `n_cells`, `horizon`, `tick`, `step_fraction`, `conv_tol`, `nodes`, the
    policies and the name of a custom `draw`; `generator`, a fingerprint of a given
    `scenario`, `step_rule`, `ladder`, `tau_scales`, `step_base`, `worst_case` and
    `starts` where they differ from their defaults) and the package version; `chunk` is not
    among them (a scenario's record does not depend on its chunk, up to rounding: chunks
    of 2, 3 and 4 gave identical records, a chunk of 1 differed by one ulp), so a resumed
    run may use another.

    **Raises:** `ValueError` when `out_dir` holds a run with other settings (naming each
    changed field with its old and new value) or of another dlbfluid version, or
    `results.jsonl` without a manifest (a run whose settings were not recorded); `out_dir`
    is left untouched then.
    """
    procs = Processes() if processes is None else processes
    for key, choice, choices in (
        ("generator", generator, VERIFY_GENERATORS),
        ("step_rule", step_rule, STEP_RULES),
        ("ladder", ladder, VERIFY_LADDERS),
        ("step_base", step_base, STEP_BASES),
    ):
        if choice not in choices:
            raise ValueError(f"{key} = {choice!r} is invalid: allowed values are {list(choices)}")
    tau_scales = tuple(float(v) for v in tau_scales)
    if not tau_scales or any(not (math.isfinite(v) and v > 0) for v in tau_scales):
        raise ValueError(f"tau_scales = {tau_scales!r} is invalid: expected scales > 0")
    if 1.0 not in tau_scales:
        tau_scales = (1.0, *tau_scales)
    if scenario is not None and n_scenarios != 1:
        raise ValueError(
            f"n_scenarios = {n_scenarios!r} is invalid with a given scenario: expected 1"
        )
    for name, v, ok in (
        ("n_scenarios", n_scenarios, isinstance(n_scenarios, int) and n_scenarios >= 1),
        ("chunk", chunk, chunk is None or (isinstance(chunk, int) and chunk >= 1)),
        (
            "starts",
            starts,
            isinstance(starts, int) and not isinstance(starts, bool) and starts >= 1,
        ),
        ("step_fraction", step_fraction, 0 < step_fraction),
    ):
        if not ok:
            raise ValueError(f"{name} = {v!r} is invalid: expected a positive value")
    K = int(round(horizon / tick))
    if abs(K * tick - horizon) > 1e-9 * horizon:
        raise ValueError(f"horizon = {horizon} is not a whole number of ticks of {tick}")
    pols = flow_policies(policies)
    if step_rule == "paper":
        for p, c in pols:
            if c not in STEP_RULE_KAPPA:
                raise ValueError(
                    f"step_rule = 'paper' is invalid for policy {p!r}: kappa is calibrated "
                    f"for the costs {list(STEP_RULE_KAPPA)} only; use step_rule = 'oracle'"
                )
    path = None
    done: dict[int, dict] = {}
    state: dict | None = None
    if procs.main:
        try:
            if out_dir is not None:
                config = {
                    "n_scenarios": n_scenarios,
                    "seed": seed,
                    "n_cells": list(n_cells),
                    "horizon": horizon,
                    "tick": tick,
                    "step_fraction": step_fraction,
                    "conv_tol": conv_tol,
                    "nodes": nodes,
                    "policies": [p for p, _ in pols],
                    "draw": None if draw is None else _qualified_name(draw),
                }
                # Settings added later are recorded when they differ from their defaults,
                # so a run with the defaults keeps the manifest it always had.
                for key, value, default in (
                    ("generator", generator, "random"),
                    ("scenario", None if scenario is None else _digest(scenario), None),
                    ("step_rule", step_rule, "oracle"),
                    ("ladder", ladder, "none"),
                    ("tau_scales", list(tau_scales) if ladder == "full" else None, None),
                    ("step_base", step_base, "eta-star"),
                    ("worst_case", worst_case, False),
                    ("starts", starts if worst_case else None, None),
                ):
                    if value != default:
                        config[key] = value
                resumed = open_manifest(
                    out_dir, "verify", config, labels=_FLAGS, results=("results.jsonl",)
                )
                path = Path(out_dir) / "results.jsonl"
                done = _read_done(path)
                if resumed:
                    resume_note(out_dir, len(done), n_scenarios, "scenarios")
        except ValueError as e:  # (told to every process: none starts)
            state = {"error": str(e)}
        else:
            state = {"todo": [i for i in range(n_scenarios) if i not in done]}
    # (process 0 alone reads the results file: the others learn from it what is left)
    state = procs.broadcast(state, "verify/todo")
    assert state is not None
    if "error" in state:
        raise ValueError(state["error"])
    todo = state["todo"]
    if scenario is not None:
        given = dict(scenario)
        source = lambda sd, i: {**given, "index": i}  # noqa: E731
    elif draw is not None:
        source = draw
    elif generator == "appb":
        source = _AppB(n_cells)
    else:
        source = lambda sd, i: draw_scenario(sd, i, n_cells=n_cells)  # noqa: E731
    opts = _Options(step_fraction, conv_tol, nodes, step_rule, ladder, tau_scales, step_base,
                    WorstCaseSearch(starts=starts, vertex_starts=min(2, starts)) if worst_case
                    else None)  # fmt: skip
    t_start = time.perf_counter()
    bar = None

    def note(c, total):
        # (a line between the policies of a chunk, so that a long chunk shows progress)
        return lambda what: bar.update(len(done), note=f"chunk {c + 1}/{total}: {what}")

    if not procs.main:
        report = None
    elif callable(progress):
        report = progress
    elif progress:
        bar = Progress("verifying", n_scenarios, unit="scenarios")
        report = lambda d, total, t0: bar.update(d, start=len(done))  # noqa: E731
    else:
        report = None
    if report:
        report(len(done), n_scenarios, t_start)
    # A chunk wider than the run would only simulate padding; by default a short run gets
    # at least four chunks, so that it shows progress before its end (records do not
    # depend on the chunk).
    chunk = min(DEFAULT_CHUNK, max(1, -(-n_scenarios // 4))) if chunk is None else chunk
    chunk = min(chunk, n_scenarios)
    chunks = [todo[c0 : c0 + chunk] for c0 in range(0, len(todo), chunk)]
    # Each process computes whole chunks, the next `procs.count` of them at a time (one
    # each), so every scenario is computed in the chunk a one-process run gives it, and
    # the results file grows in the same order.
    for r0 in range(0, len(chunks), procs.count):
        batch = chunks[r0 : r0 + procs.count]
        mine = [
            rec
            for k in procs.share(len(batch))
            for rec in _chunk_records(
                batch[k], seed, source, pols, chunk, n_cells, tick, horizon, K, opts,
                on_stage=note(r0 + k, len(chunks)) if bar is not None else None,
            )
        ]  # fmt: skip
        shares = procs.gather(mine, "verify/chunk")
        if shares is None:
            continue
        recs = [rec for share in shares for rec in share]
        if path is not None:
            with open(path, "a") as fh:
                for rec in recs:
                    fh.write(json.dumps(rec) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        for rec in recs:
            done[rec["index"]] = rec
        if report:
            report(len(done), n_scenarios, t_start)
    if not procs.main:
        return None
    records = [done[i] for i in range(n_scenarios)]
    summary = summarise(records)
    summary.update(
        seed=seed,
        horizon=horizon,
        tick=tick,
        step_fraction=step_fraction,
        conv_tol=conv_tol,
        generator=generator if scenario is None and draw is None else None,
        step_rule=step_rule,
        step_base=step_base,
        worst_case=worst_case,
        starts=starts if worst_case else None,
        ladder=ladder,
        tau_scales=list(tau_scales) if ladder == "full" else None,
        devices=[str(d) for d in jax.devices()],
        wall_s=time.perf_counter() - t_start,
    )
    if out_dir is not None:
        (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["records"] = records
    return summary


SEARCH_KEYS = ("eta_global", "bistable", "hopf", "witness", "cycle_amplitude", "cycle_period")
"""The worst-case search's fields of a record's `thresholds` (null without `worst_case`)."""

DEFAULT_CHUNK = 32
"""Scenarios per compiled batch of `verify` unless a run of fewer than 128 asks for less."""

# The command-line option of each field of the manifest, for its messages.
_FLAGS = {
    "n_scenarios": "--scenarios",
    "seed": "--seed",
    "n_cells": "--min-cells, --max-cells",
    "horizon": "--horizon",
    "tick": "--tick",
    "step_fraction": "--step-fraction",
    "conv_tol": "--conv-tol",
    "generator": "--generator",
    "scenario": "--scenario",
    "step_rule": "--step-rule",
    "ladder": "--ladder",
    "tau_scales": "--tau-scales",
    "policies": "--policy",
    "step_base": "--step-base",
    "worst_case": "--worst-case",
    "starts": "--starts",
}


class _Options(NamedTuple):
    """The per-scenario settings of a run (every one is in the manifest)."""

    step_fraction: float
    conv_tol: float
    nodes: int
    step_rule: str
    ladder: str
    tau_scales: tuple[float, ...]
    step_base: str
    worst_case: WorstCaseSearch | None


def _digest(d: dict) -> str:
    """A short fingerprint of a given scenario (the manifest records it, not the file)."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _qualified_name(fn) -> str:
    """`module.qualname` of a scenario source (of its type for a callable object): the
    identity the manifest records (a changed body under the same name goes unnoticed)."""
    obj = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"


def _chunk_records(
    idx, seed, source, pols, chunk, n_cells, tick, horizon, K, opts, on_stage=None
) -> list[dict]:
    """The records of the scenarios `idx` (at most `chunk`), computed as one batch."""
    many = getattr(source, "many", None)
    dicts = many(seed, idx) if many is not None else [source(seed, i) for i in idx]
    scns = [
        scenario_from_dict({k: v for k, v in d.items() if k not in ("index", "utilisation")})
        for d in dicts
    ]
    # Pad the chunk to a fixed batch and cell count: one compilation serves all chunks.
    fill = scns + [scns[-1]] * (chunk - len(scns))
    batch = stack_scenarios(fill, n_cells=max([n_cells[1]] + [s.n_cells for s in scns]))
    n = batch.n_cells
    recs = [
        {
            "index": i,
            "n_cells": s.n_cells,
            "utilisation": d.get("utilisation", _utilisation(s)),
            "policies": {},
        }
        for i, s, d in zip(idx, scns, dicts)
    ]
    stage = on_stage if on_stage is not None else (lambda what: None)
    for pol, cost in pols:
        stage(f"{pol}: equilibria")
        eq = solve_equilibrium(batch, cost, throw=False, check=False)
        eq_ok = eq.status_names() == "success"
        if opts.step_rule == "paper":
            steps = paper_step_sizes(fill, cost, n)
            weights = steps / np.maximum(steps.max(axis=1, keepdims=True), 1e-300)
        else:
            steps, weights = None, None
        stage(f"{pol}: critical steps")
        crit = batch_critical_step_size(batch, pol, eq, step_weights=weights)
        eta_star = np.where(eq_ok, np.asarray(crit.critical_step_size), np.nan)
        usable = np.isfinite(eta_star) & (eta_star > 0)
        scn = batch.strip()
        stage(f"{pol}: Theorem-1 constants")
        consts = batch_theorem1_constants(cost, scn, eq.N, eq.x)
        eta0 = np.where(eq_ok, np.asarray(consts.eta0), np.nan)
        if steps is None:
            base = eta0 if opts.step_base == "eta0" else eta_star
            ok_base = np.isfinite(base) & (base > 0)
            eta = np.where(ok_base, opts.step_fraction * base, 0.05)
            eta_routers = np.broadcast_to(eta[:, None], (chunk, n))
        else:
            eta_routers = steps
            eta = steps.max(axis=1)
        ratio = np.where(usable, eta / np.where(usable, eta_star, 1.0), np.nan)
        stage(f"{pol}: simulating")
        sol = simulate(
            batch,
            pol,
            step_size=np.asarray(eta_routers) if steps is not None else eta[:, None],
            tick=tick,
            horizon=horizon,
            n_save=K,
            throw=False,
        )
        eta_j = jnp.asarray(eta_routers)
        ticks = jnp.full(chunk, tick)
        stage(f"{pol}: checking Theorem 1")
        proj = batch_projection_check(cost, scn, eq.N, eq.x, eta_j, ticks, sol.t, sol.N, sol.x)
        terms = batch_start_terms(cost, consts, scn, eq.N, eq.x, sol.N[:, 0], sol.x[:, 0], eta_j)
        thm = batch_theorem1_check(cost, consts, terms, scn, eq.N, eq.x, eta_j, ticks, sol.t,
                                   sol.N, sol.x)  # fmt: skip
        tad = np.asarray(proj.lhs) / horizon
        Nf = np.asarray(sol.N[:, -1])
        Ns = np.asarray(eq.N)
        osc = np.asarray(sol.oscillation())
        st = sol.status_names()
        eqst = eq.status_names()
        crst = crit.status_names()
        search: list[dict] = [{} for _ in recs]
        if opts.worst_case is not None:
            stage(f"{pol}: worst-case search")
            search = global_threshold(batch, pol, eq, eta_star, config=opts.worst_case)
        theorem: list[dict] = [{} for _ in recs]
        if opts.ladder == "full":
            lad = Ladder(tau_scales=opts.tau_scales)
            eqs, stars = {1.0: eq}, {1.0: eta_star}
            for sc in opts.tau_scales:
                if sc != 1.0:
                    scaled = scale_delays(batch, sc)
                    eqs[sc] = solve_equilibrium(scaled, cost, throw=False, check=False)
                    ok_s = eqs[sc].status_names() == "success"
                    cs = batch_critical_step_size(scaled, pol, eqs[sc], step_weights=weights)
                    stars[sc] = np.where(ok_s, np.asarray(cs.critical_step_size), np.nan)
            theorem = theorem1_ladder(
                batch, pol, eqs, stars, horizon=horizon, tick=tick, ladder=lad,
                n_real=len(recs),
            )  # fmt: skip
        for b, rec in enumerate(recs):
            nb = rec["n_cells"]
            dist = float(np.max(np.abs(Nf[b, :nb] - Ns[b, :nb])))
            scale = max(1.0, float(np.max(Ns[b, :nb])))
            es = float(eta_star[b])
            th = theorem[b]
            one = {
                "step_size": float(eta[b]),
                "critical_step_size": es if math.isfinite(es) else None,
                "critical_step_status": str(crst[b]),
                "eta_over_eta_star": float(ratio[b]) if math.isfinite(ratio[b]) else None,
                "time_average_distance": float(tad[b]),
                "final_distance": dist,
                "oscillation": float(osc[b]),
                "converged": bool(dist <= opts.conv_tol * scale and st[b] == "success"),
                "status": str(st[b]),
                "equilibrium_status": str(eqst[b]),
                "kkt_residual": float(np.asarray(eq.kkt_residual)[b]),
                "theorem1": theorem1_record(consts, terms, thm, b, nb) if eq_ok[b] else None,
                "thresholds": {
                    "eta0": _finite(eta0[b]),
                    "eta_star": es if math.isfinite(es) else None,
                    **{k: search[b].get(k) for k in SEARCH_KEYS},
                },
                "projection_check": proj.record(b),
                "bound": th.get("bound"),
                "schedule_slope": th.get("schedule_slope"),
                "schedule_delay_share": th.get("schedule_delay_share"),
                "g1_growth_exponent": th.get("g1_growth_exponent"),
                "g1_by_tau_scale": th.get("g1_by_tau_scale"),
                "empirical_eta0": th.get("empirical_eta0"),
                "empirical_eta0_over_eta_star": th.get("empirical_eta0_over_eta_star"),
            }
            if steps is not None:
                one["step_sizes"] = [float(v) for v in steps[b, :nb]]
            rec["policies"][pol] = one
        stage(f"{pol} done")
    return recs


def _finite(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def _utilisation(scn) -> float:
    """$\\sum_i\\lambda_i(0)/\\sum_j\\bar\\mu_j$ of one scenario."""
    lam = np.asarray(scn.arrival_rate(0.0))
    return float(lam.sum() / np.asarray(scn.service.capacity).sum())
