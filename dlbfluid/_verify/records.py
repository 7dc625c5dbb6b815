"""The records of one chunk of `verify`: equilibria, critical steps, Theorem 1's constants,
one run per scenario and flow policy, Theorem 1's check and the projection check along it,
and optionally the worst-case search and the descriptive ladder, as one batch per policy."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .._equilibrium import solve_equilibrium
from .._evaluation.step_rule import paper_step_sizes
from .._global_threshold import RECORD_KEYS, WorstCaseSearch, global_threshold
from .._scenario import scenario_from_dict, stack_scenarios
from .._service import BUILTIN_LAWS
from .._simulate import simulate
from .._stability import batch_critical_step_size, scale_delays
from .._theorem1 import (
    Ladder,
    batch_projection_check,
    batch_start_terms,
    batch_theorem1_check,
    batch_theorem1_constants,
    theorem1_ladder,
)
from .._theorem1.check import theorem1_record

SEARCH_KEYS = RECORD_KEYS + ("step_vs_bracket",)
"""The worst-case search's fields of a record's `thresholds` (null without `worst_case`):
`global_threshold`'s and where the run's step lies against the bracket (`step_vs_bracket`)."""


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
    # Both service laws of the random networks in every chunk, whichever its scenarios use:
    # the law set is static, so a chunk of one law alone would compile its own programs.
    batch = stack_scenarios(fill, n_cells=max([n_cells[1]] + [s.n_cells for s in scns]),
                            laws=BUILTIN_LAWS)  # fmt: skip
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
        run = _Run(batch, fill, pol, cost, chunk, tick, horizon, K, opts, stage, len(recs))
        for b, rec in enumerate(recs):
            rec["policies"][pol] = run.record(b, rec["n_cells"])
        stage(f"{pol} done")
    return recs


class _Run:
    """One flow policy on one chunk: its equilibria, critical steps, Theorem 1's constants,
    the steps, the run, Theorem 1's check and the projection check, the optional search
    and ladder (host arrays over the chunk), and each scenario's record (`record`)."""

    def __init__(self, batch, fill, pol, cost, chunk, tick, horizon, K, opts: _Options, stage,
                 n_real):  # fmt: skip
        self.opts = opts
        n = batch.n_cells
        stage(f"{pol}: equilibria")
        eq = self.eq = solve_equilibrium(batch, cost, throw=False, check=False)
        eq_ok = self.eq_ok = eq.status_names() == "success"
        if opts.step_rule == "paper":
            steps = paper_step_sizes(fill, cost, n)
            weights = steps / np.maximum(steps.max(axis=1, keepdims=True), 1e-300)
        else:
            steps, weights = None, None
        self.steps = steps
        stage(f"{pol}: critical steps")
        crit = batch_critical_step_size(batch, pol, eq, step_weights=weights)
        self.crit_status = crit.status_names()
        eta_star = self.eta_star = np.where(eq_ok, np.asarray(crit.critical_step_size), np.nan)
        usable = np.isfinite(eta_star) & (eta_star > 0)
        scn = batch.strip()
        stage(f"{pol}: Theorem-1 constants")
        consts = self.consts = batch_theorem1_constants(cost, scn, eq.N, eq.x)
        self.eta0 = np.where(eq_ok, np.asarray(consts.eta0), np.nan)
        if steps is None:
            base = self.eta0 if opts.step_base == "eta0" else eta_star
            ok_base = np.isfinite(base) & (base > 0)
            eta = np.where(ok_base, opts.step_fraction * base, 0.05)
            eta_routers = np.broadcast_to(eta[:, None], (chunk, n))
        else:
            eta_routers = steps
            eta = steps.max(axis=1)
        self.eta = eta
        self.ratio = np.where(usable, eta / np.where(usable, eta_star, 1.0), np.nan)
        stage(f"{pol}: simulating")
        sol = simulate(batch, pol, step_size=np.asarray(eta_routers) if steps is not None
                       else eta[:, None], tick=tick, horizon=horizon, n_save=K,
                       throw=False)  # fmt: skip
        eta_j = jnp.asarray(eta_routers)
        ticks = jnp.full(chunk, tick)
        stage(f"{pol}: checking Theorem 1")
        self.proj = batch_projection_check(cost, scn, eq.N, eq.x, eta_j, ticks, sol.t, sol.N,
                                           sol.x)  # fmt: skip
        self.terms = batch_start_terms(cost, consts, scn, eq.N, eq.x, sol.N[:, 0], sol.x[:, 0],
                                       eta_j)  # fmt: skip
        self.thm = batch_theorem1_check(cost, consts, self.terms, scn, eq.N, eq.x, eta_j, ticks,
                                        sol.t, sol.N, sol.x)  # fmt: skip
        self.tad = np.asarray(self.proj.lhs) / horizon
        self.Nf, self.Ns = np.asarray(sol.N[:, -1]), np.asarray(eq.N)
        self.osc = np.asarray(sol.oscillation())
        self.status, self.eq_status = sol.status_names(), eq.status_names()
        self.search: list[dict] = [{} for _ in range(chunk)]
        if opts.worst_case is not None:
            stage(f"{pol}: worst-case search")
            self.search = global_threshold(batch, pol, eq, eta_star, config=opts.worst_case,
                                           step_weights=weights)  # fmt: skip
        self.theorem: list[dict] = [{} for _ in range(chunk)]
        if opts.ladder == "full":
            self.theorem = _ladder(batch, pol, cost, eq, eta_star, weights, tick, horizon, opts,
                                   n_real)  # fmt: skip

    def record(self, b: int, nb: int) -> dict:
        """Scenario `b`'s record (`nb` real cells)."""
        dist = float(np.max(np.abs(self.Nf[b, :nb] - self.Ns[b, :nb])))
        scale = max(1.0, float(np.max(self.Ns[b, :nb])))
        es = _finite(self.eta_star[b])
        th = self.theorem[b]
        one = {
            "step_size": float(self.eta[b]),
            "critical_step_size": es,
            "critical_step_status": str(self.crit_status[b]),
            "eta_over_eta_star": _finite(self.ratio[b]),
            "time_average_distance": float(self.tad[b]),
            "final_distance": dist,
            "oscillation": float(self.osc[b]),
            "converged": bool(dist <= self.opts.conv_tol * scale and self.status[b] == "success"),
            "status": str(self.status[b]),
            "equilibrium_status": str(self.eq_status[b]),
            "kkt_residual": float(np.asarray(self.eq.kkt_residual)[b]),
            "theorem1": (
                theorem1_record(self.consts, self.terms, self.thm, b, nb) if self.eq_ok[b] else None
            ),  # fmt: skip
            "thresholds": {
                "eta0": _finite(self.eta0[b]),
                "eta_star": es,
                **{k: self.search[b].get(k) for k in RECORD_KEYS},
                "step_vs_bracket": step_vs_bracket(
                    float(self.eta[b]), self.search[b].get("eta_global_bracket")
                ),
            },
            "projection_check": self.proj.record(b),
            **{k: th.get(k) for k in LADDER_KEYS},
        }
        if self.steps is not None:
            one["step_sizes"] = [float(v) for v in self.steps[b, :nb]]
        return one


LADDER_KEYS = ("bound", "schedule_slope", "schedule_delay_share", "g1_growth_exponent",
               "g1_by_tau_scale", "empirical_eta0", "empirical_eta0_over_eta_star")  # fmt: skip
"""The descriptive ladder's fields of a record (null without `ladder="full"`)."""


def _ladder(batch, pol, cost, eq, eta_star, weights, tick, horizon, opts: _Options, n_real):
    """The descriptive ladder's records: equilibria and critical steps at every delay
    scale, then `theorem1_ladder`."""
    eqs, stars = {1.0: eq}, {1.0: eta_star}
    for sc in opts.tau_scales:
        if sc != 1.0:
            scaled = scale_delays(batch, sc)
            eqs[sc] = solve_equilibrium(scaled, cost, throw=False, check=False)
            ok_s = eqs[sc].status_names() == "success"
            cs = batch_critical_step_size(scaled, pol, eqs[sc], step_weights=weights)
            stars[sc] = np.where(ok_s, np.asarray(cs.critical_step_size), np.nan)
    return theorem1_ladder(batch, pol, eqs, stars, horizon=horizon, tick=tick,
                           ladder=Ladder(tau_scales=opts.tau_scales), n_real=n_real)  # fmt: skip


def step_vs_bracket(eta: float, bracket) -> str | None:
    """Where the run's step $\\eta$ (the largest router step) lies against the global
    threshold's bracket $[\\eta_{lo}, \\eta_{hi}]$: `"below_lo"`, `"inside"`, `"above_hi"`, or
    `"undetermined"` when an open end of a censored bracket leaves it open (`None` without a
    bracket). For the paper's rule this is "is the rule safe from every start searched"."""
    if bracket is None:
        return None
    lo, hi = bracket
    if lo is not None and eta < lo:
        return "below_lo"
    if hi is not None and eta > hi:
        return "above_hi"
    if lo is not None and hi is not None:
        return "inside"
    return "undetermined"


def _finite(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def _utilisation(scn) -> float:
    """$\\sum_i\\lambda_i(0)/\\sum_j\\bar\\mu_j$ of one scenario."""
    lam = np.asarray(scn.arrival_rate(0.0))
    return float(lam.sum() / np.asarray(scn.service.capacity).sum())
