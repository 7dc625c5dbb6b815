"""The global step-size threshold $\\eta_g$ of flow routing, bracketed by a batched search.

$\\eta^*$ (`batch_critical_step_size`) is where the linearisation at the equilibrium loses
stability; below it the equilibrium attracts the starts near it, not necessarily all of
them. When the Hopf bifurcation at $\\eta^*$ is subcritical, a large stable limit cycle
coexists with the stable equilibrium on a band of step sizes below $\\eta^*$, and only some
starts find it. This module brackets the lowest step with such a cycle
(theory/global_threshold.md):

* the starts $(N(0), x(0))$ per scenario, the same at every step: cold vertex starts
  (every router on one corner of its simplex, $N = 0$), random ones (uniform $N(0)$,
  Dirichlet $x(0)$) and adversarial ones (the first starts refined by projected,
  normalised gradient ascent on the late-window mean of $\\sum_jD_j$ at the top of the
  range, differentiated through the simulator's own tick, `_ascend`). The model's
  history before $t = 0$ is constant and equal to the start, so a start is the pair
  $(N(0), x(0))$ and nothing else;
* a coarse geometric ladder over `search_range` (in units of $\\eta^*$), then bisections
  in $\\log\\eta$ of the interval between the highest step without a cycle and the lowest
  with one, until it is narrower than `bracket_tol` of its top;
* at every step every (step, start, scenario) advanced as one vmapped batch through the
  simulator's tick, accumulating late-window statistics instead of saving trajectories;
  a run is *non-decaying* when its workload gap does not fall between the two halves of
  the late window and its last-quarter peak-to-peak workload is not small
  (`non_decaying`);
* a step has a cycle only when the non-decaying run with the largest late gap, restarted
  from its final state at half the tick for twice the horizon, keeps its amplitude and
  period (`_verified`): that state is the witness.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._integrators import Fast
from .._precision import require_x64
from .._results import RESULTS
from .._runtime.devices import shard_batch
from .._scenario import Scenario
from .._simulate import (
    _chosen_chunk,
    _hist_len,
    _window_width,
)
from .._stability import _flow_policy
from .._validate import invalid
from .config import WorstCaseSearch, check_search_range
from .stats import WorkloadStats, _ascend, _late_stats, _scale, _with_start, non_decaying


def _starts(batch: Scenario, N_star: np.ndarray, config: WorstCaseSearch):
    """`(S, B, n)` workloads and `(S, B, n, n)` routings of the starts (host side)."""
    allowed = np.asarray(batch.allowed)
    mask = np.asarray(batch.cell_mask)
    B, n = mask.shape
    S, V = config.starts, config.vertex_starts
    rng = np.random.default_rng([config.seed, B, n])
    N0 = np.zeros((S, B, n))
    x0 = np.zeros((S, B, n, n))
    rank = np.cumsum(allowed, axis=-1) - 1  # index of each allowed arc in its row
    m = allowed.sum(axis=-1)  # (B, n)
    for v in range(V):
        pick = np.where(m > 0, v % np.maximum(m, 1), -1)
        x0[v] = (allowed & (rank == pick[..., None])).astype(float)
    R = S - V
    if R:
        hi = config.workload_scale * (1.0 + N_star)
        N0[V:] = rng.uniform(0.0, 1.0, (R, B, n)) * hi * mask
        g = rng.gamma(config.dirichlet, 1.0, (R, B, n, n)) * allowed
        g = np.where(allowed, np.maximum(g, 1e-300), 0.0)
        x0[V:] = g / np.maximum(g.sum(axis=-1, keepdims=True), 1e-300)
    return N0, x0


def _flat(tree, R: int, S: int):
    """Leaves `(B, ...)` broadcast to `(R * S * B, ...)`, rung-major."""
    return jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a, (R, S) + a.shape).reshape((-1,) + a.shape[1:]), tree
    )


def _witness(N: np.ndarray, x: np.ndarray, n: int, amplitude: float, period: float) -> dict:
    """A verified witness: a state on the cycle in the scenario file's `initial` form (the
    scenario's own `n` cells, rows renormalised) and the cycle's amplitude and period."""
    x = np.clip(x[:n, :n], 0.0, None)
    tot = x.sum(axis=-1, keepdims=True)
    x = np.where(tot > 0, x / np.where(tot > 0, tot, 1.0), 0.0)
    return {
        "workload": [float(v) for v in np.clip(N[:n], 0.0, None)],
        "routing": [[float(v) for v in row] for row in x],
        "amplitude": float(amplitude),
        "period": float(period),
    }


class _Runs:
    """One batch's scenarios, prepared once for every pass of the search: `stats` runs
    steps x starts x scenarios through `_late_stats` and returns host arrays."""

    def __init__(self, batch: Scenario, policy, equilibrium, eta_star, step_weights,
                 config: WorstCaseSearch):  # fmt: skip
        self.pol = _flow_policy(policy)
        require_x64("global_threshold")
        if not isinstance(config, WorstCaseSearch):
            raise ValueError(f"config = {config!r} is invalid: expected a WorstCaseSearch")
        if len(batch.batch_shape) != 1:
            raise ValueError(
                f"batch has batch shape {batch.batch_shape}: expected one batch axis "
                "(stack_scenarios)"
            )
        B, n = batch.batch_shape[0], batch.n_cells
        es = np.asarray(eta_star, dtype=float)
        if es.shape != (B,):
            raise ValueError(f"eta_star has shape {es.shape}: expected ({B},), one per scenario")
        N_star = np.asarray(equilibrium.N, dtype=float)
        if N_star.shape != (B, n):
            raise ValueError(f"equilibrium.N has shape {N_star.shape}: expected ({B}, {n})")
        w = np.ones((B, n)) if step_weights is None else np.asarray(step_weights, dtype=float)
        if w.shape != (B, n) or not np.all(np.isfinite(w) & (w >= 0)):
            raise invalid("step_weights", f"array of shape {w.shape}",
                          f"expected ({B}, {n}) finite weights >= 0")  # fmt: skip
        self.config, self.B, self.n = config, B, n
        self.usable = np.isfinite(es) & (es > 0) & np.all(np.isfinite(N_star), axis=-1)
        self.eta_star = np.where(self.usable, es, 1.0)
        self.N_star, self.w = N_star, w
        scn = batch.strip()
        self.scn = jax.tree_util.tree_map(
            lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
        )
        self.cells = np.asarray(self.scn.cell_mask).sum(axis=-1)

    def _static(self, h: float):
        """`(hist, window, integrator)` of tick `h` (host side)."""
        scn = self.scn
        tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
        hist = _hist_len(float(tau.max() / h))
        window = _window_width(
            np.asarray(scn.arrival_times), float(tau.max() + 2.0 * h),
            np.asarray(scn.arrival_rates),
        )  # fmt: skip
        return hist, window, Fast().for_batch(scn, h).prepared(jnp.float64)

    def _eta(self, steps: np.ndarray, S: int) -> jax.Array:
        """Per-run router steps `(P * S * B, n)`: step $\\times$ the scenario's weights."""
        P = steps.shape[0]
        eta = steps[:, None, :, None] * self.w[None, None]
        return jnp.asarray(np.broadcast_to(eta, (P, S, self.B, self.n)).reshape(-1, self.n))

    def stats(self, steps, N0, x0, h: float, K: int) -> WorkloadStats:
        """`WorkloadStats` (host arrays `(P, S, B, ...)`) of the runs of `steps` `(P, B)` from
        the starts `N0` `(P, S, B, n)`, `x0` `(P, S, B, n, n)`, for `K` ticks of `h`."""
        P, S = N0.shape[:2]
        n, B = self.n, self.B
        late = max(int(round(self.config.late_window * K)), 2)
        hist, window, integrator = self._static(h)
        M = P * S * B
        runs = (
            _with_start(_flat(self.scn, P, S), jnp.asarray(N0.reshape(M, n)),
                        jnp.asarray(x0.reshape(M, n, n))),
            self._eta(steps, S),
            _flat(jnp.asarray(self.N_star), P, S),
        )  # fmt: skip
        # Split the runs over this process's devices (one per core after `use_cpu_cores`),
        # the last run repeated to fill the last device's share.
        ndev = jax.local_device_count()
        pad = (-M) % ndev
        if pad:
            runs = jax.tree_util.tree_map(
                lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), runs
            )
        marks = np.array([K - late, K - late // 2, K])
        ticks = (jnp.full((M + pad,), h), jnp.asarray(np.broadcast_to(marks, (M + pad, 3))))
        (scn_r, eta_r, Ns_r), (h_r, K_r) = shard_batch((runs, ticks))
        chunk = _chosen_chunk(None, n, (M + pad) // ndev)
        out = _late_stats(scn_r, eta_r, Ns_r, h_r, K_r, self.pol, integrator, hist=hist,
                          window=window, chunk=chunk)  # fmt: skip
        return jax.tree_util.tree_map(
            lambda a: np.asarray(a)[:M].reshape((P, S, B) + a.shape[1:]), out
        )

    def adversarial(self, N0, x0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first `ascent_starts` starts `(A, B, ...)` refined by `ascent_steps` steps of
        gradient ascent (`_ascend`) at the top of the range, $H\\eta^*$: `(N, x, history)`,
        `history` `(steps, A, B)` the objective at each iterate (row 0: the starts' own)."""
        cfg = self.config
        A, n = cfg.ascent_starts, self.n
        h = float(cfg.tick)
        hist, window, integrator = self._static(h)
        top = (float(cfg.search_range[1]) * self.eta_star)[None]
        Na, xa, history = _ascend(
            _flat(self.scn, 1, A), self._eta(top, A), jnp.asarray(h, jnp.float64),
            _flat(jnp.asarray(self.N_star), 1, A), jnp.asarray(N0[:A].reshape(-1, n)),
            jnp.asarray(x0[:A].reshape(-1, n, n)), self.pol, integrator,
            jnp.asarray(cfg.ascent_rate, jnp.float64),
            K=int(round(cfg.ascent_horizon / h)), steps=cfg.ascent_steps, hist=hist,
            window=window,
        )  # fmt: skip
        return (
            np.asarray(Na).reshape(A, self.B, n),
            np.asarray(xa).reshape(A, self.B, n, n),
            np.asarray(history).reshape(-1, A, self.B),
        )


class _Steps(NamedTuple):
    """The verdict of every step of one pass (host arrays `(P, B)`)."""

    cycle: np.ndarray  # a verified witness
    failed: np.ndarray  # some run (search or re-run) not `success`, and no verified cycle
    rejected: np.ndarray  # non-decaying runs, but the best one failed its re-run
    N: np.ndarray  # (P, B, n) the witness state (where `cycle`)
    x: np.ndarray  # (P, B, n, n)
    amplitude: np.ndarray  # the re-run's last-quarter amplitude
    period: np.ndarray  # and period


def _verified(search: WorkloadStats, again: WorkloadStats, config: WorstCaseSearch):
    """Whether each re-run confirms its search run: both succeeded, the re-run's late
    amplitude is within `verify_amplitude` and its period within `verify_period` (relative)
    of the search run's; a run whose period was not measured is not confirmed."""
    ok = (np.asarray(search.status) == int(RESULTS.success)) & (
        np.asarray(again.status) == int(RESULTS.success)
    )
    a0, a1 = np.asarray(search.amp4), np.asarray(again.amp4)
    p0, p1 = np.asarray(search.period), np.asarray(again.period)
    with np.errstate(invalid="ignore", divide="ignore"):
        amp = np.abs(a1 - a0) <= config.verify_amplitude * a0
        per = np.isfinite(p0) & np.isfinite(p1) & (np.abs(p1 - p0) <= config.verify_period * p0)
    return ok & amp & per


def _pass(runs: _Runs, steps: np.ndarray, N0: np.ndarray, x0: np.ndarray) -> _Steps:
    """Run every start at every step `(P, B)`, then re-run each step's best non-decaying
    run from its final state at half the tick for twice the horizon (`_verified`)."""
    cfg = runs.config
    P = steps.shape[0]
    h = float(cfg.tick)
    K = int(round(cfg.horizon / h))
    S = N0.shape[0]
    shape = (P,) + N0.shape
    st = runs.stats(steps, np.broadcast_to(N0, shape), np.broadcast_to(x0, (P,) + x0.shape),
                    h, K)  # fmt: skip
    ok = np.asarray(st.status) == int(RESULTS.success)
    Ns = np.broadcast_to(runs.N_star, (P, S) + runs.N_star.shape)
    cand = non_decaying(st, Ns, cfg) & ok
    best = np.argmax(np.where(cand, np.asarray(st.gap4), -np.inf), axis=1)  # (P, B)
    has = cand.any(axis=1)

    def pick(a):
        a = np.asarray(a)
        idx = best.reshape((P, 1, runs.B) + (1,) * (a.ndim - 3))
        return np.take_along_axis(a, idx, axis=1)  # (P, 1, B, ...)

    N1, x1 = pick(st.final_N), pick(st.final_x)
    again = runs.stats(steps, N1, x1, 0.5 * h, 4 * K)
    first = jax.tree_util.tree_map(lambda a: pick(a)[:, 0], st)
    again = jax.tree_util.tree_map(lambda a: np.asarray(a)[:, 0], again)
    cycle = has & _verified(first, again, cfg)
    re_failed = has & (np.asarray(again.status) != int(RESULTS.success))
    failed = ~cycle & ((~ok).any(axis=1) | re_failed)
    return _Steps(
        cycle=cycle,
        failed=failed,
        rejected=has & ~cycle & ~failed,
        N=N1[:, 0],
        x=x1[:, 0],
        amplitude=np.asarray(again.amp4),
        period=np.asarray(again.period),
    )


class _Bracket(NamedTuple):
    """Per scenario: the bracket (in absolute steps, NaN where open), its censoring, the
    witness's pass and step index, and the search's counts."""

    lo: np.ndarray
    hi: np.ndarray
    censoring: np.ndarray  # of CENSORING
    witness: list  # (steps, p) or None per scenario
    steps: np.ndarray  # steps evaluated
    rejected: np.ndarray  # steps whose best non-decaying run failed its re-run


def _bracket(runs: _Runs) -> _Bracket:
    """The coarse ladder walked up from its lowest rung, then lockstep bisections in
    $\\log\\eta$. Every pass runs one step per scenario, so that one compiled program
    serves all of them (a scenario with nothing left to search repeats a step, and its
    result is unused); the ladder stops at the rung where every scenario has met a cycle
    (theory/global_threshold.md, *The search*)."""
    cfg, B = runs.config, runs.B
    N0, x0 = _starts(runs.scn, runs.N_star, cfg)
    if cfg.ascent_starts and cfg.ascent_steps:
        Na, xa, _ = runs.adversarial(N0, x0)
        N0, x0 = np.concatenate([N0, Na]), np.concatenate([x0, xa])
    lo, hi = np.full(B, np.nan), np.full(B, np.nan)
    censoring = np.full(B, "above_range", dtype=object)
    witness: list = [None] * B
    steps = np.zeros(B, int)
    rejected = np.zeros(B, int)
    open_ = runs.usable.copy()  # still climbing the ladder
    for k, rung in enumerate(cfg.rungs()):
        if not open_.any():
            break
        step = rung * runs.eta_star
        one = _pass(runs, step[None], N0, x0)
        steps, rejected = steps + open_, rejected + (open_ & one.rejected[0])
        hit = open_ & (one.cycle[0] | one.failed[0])
        for b in np.flatnonzero(hit):
            hi[b] = step[b]
            if not one.cycle[0, b]:
                censoring[b] = "failed"
            elif k == 0:
                censoring[b], witness[b] = "below_range", (one, 0)
            else:
                censoring[b], witness[b] = "bracketed", (one, 0)
        lo = np.where(open_ & ~hit, step, lo)
        open_ = open_ & ~hit
    refine = censoring == "bracketed"
    for _ in range(cfg.bisections()):
        refine = refine & (hi - lo > cfg.bracket_tol * hi)
        if not refine.any():
            break
        mid = np.where(refine, np.sqrt(np.where(refine, lo * hi, 1.0)), runs.eta_star)
        one = _pass(runs, mid[None], N0, x0)
        steps, rejected = steps + refine, rejected + (refine & one.rejected[0])
        for b in np.flatnonzero(refine & one.cycle[0]):
            hi[b], witness[b] = mid[b], (one, 0)
        lo = np.where(refine & ~one.cycle[0] & ~one.failed[0], mid, lo)
        stop = refine & one.failed[0]
        censoring = np.where(stop, "failed", censoring)
        refine = refine & ~stop
    # A bracket left wider than the tolerance (a failed run stopped it) is not bracketed.
    wide = (censoring == "bracketed") & ~(hi - lo <= cfg.bracket_tol * hi * (1 + 1e-12))
    censoring = np.where(wide, "failed", censoring)
    return _Bracket(lo, hi, censoring, witness, steps, rejected)


def global_threshold(
    batch: Scenario,
    policy,
    equilibrium,
    eta_star,
    *,
    config: WorstCaseSearch = WorstCaseSearch(),
    step_weights=None,
) -> list[dict]:
    """The global threshold $\\eta_g$ of flow routing for every scenario of a batch, as a
    bracket $[\\eta_{lo}, \\eta_{hi}]$ with a verified cycle witness at $\\eta_{hi}$.

    A step has a *cycle* when some start's run is non-decaying (`non_decaying`) and the
    one with the largest late gap, restarted from its final state at half the tick for
    twice the horizon, keeps its amplitude within `verify_amplitude` and its period within
    `verify_period` (`_verified`); $\\eta_{lo}$ is a step without one (every start decays,
    or the best non-decaying run failed its re-run) and every run succeeded there. The
    coarse ladder $L\\rho^k\\eta^*$ over `search_range` is followed by bisections in
    $\\log\\eta$ until $\\eta_{hi} - \\eta_{lo} \\le$ `bracket_tol` $\\eta_{hi}$; all
    steps $\\times$ starts $\\times$ scenarios of a pass run as one vmapped batch through
    the simulator's tick (module docstring; theory/global_threshold.md).

    **Arguments:**
    - `batch`: scenarios from `stack_scenarios` (leading axis `B`), constant arrival rates.
    - `policy`: a flow policy name (`"flow-grad"`, ...) or `FlowRouting`.
    - `equilibrium`: its cost's equilibria, batched `N` `(B, n)` (`solve_equilibrium`).
    - `eta_star`: `(B,)` linear critical steps $\\eta^*$ (`batch_critical_step_size`);
      a scenario whose $\\eta^*$ is not finite and positive gets every field `None`.
    - `config`: a `WorstCaseSearch`.
    - `step_weights`: `(B, n)` router $i$ runs at $\\eta w_i$ (the profile whose critical
      scaling `eta_star` is, e.g. the paper's step rule); default all 1.

    **Returns:** one dict per scenario with exactly the keys
    - `eta_global_bracket`: `[lo, hi]` (absolute steps; `[None, hi]` below the range,
      `[lo, None]` above it);
    - `eta_global_censoring`: `"bracketed"` (a verified cycle at `hi`, none at `lo`,
      `hi - lo <= bracket_tol * hi`), `"below_range"` (a verified cycle at the lowest
      step, $L\\eta^*$), `"above_range"` (no cycle up to $H\\eta^*$) or `"failed"` (a run
      failed numerically where the bracket would have closed);
    - `eta_global`: `hi` when bracketed, else `None`;
    - `bistable`: a verified cycle below $\\eta^*$ (`None` when failed);
    - `hopf`: `"subcritical"` when the cycle reaches below $\\eta^*$; when the bracket's
      top lies at or above $\\eta^*$, `"subcritical"` if the witness's amplitude is at
      least `onset_amplitude` $\\times\\bar N$, else `"supercritical"`; `None` otherwise;
    - `witness`: `{"workload", "routing", "amplitude", "period"}`: the verified state at
      `hi` (the scenario file's `initial` form) and its re-run's last-quarter amplitude
      (largest peak-to-peak over cells) and period (`None` without a witness);
    - `cycle_amplitude`, `cycle_period`: the witness's amplitude and period;
    - `eta_global_search`: `{"steps", "rejected"}`, the steps evaluated and those whose
      best non-decaying run was rejected by its re-run.

    **Raises:** `ValueError` for a batch without one batch axis, a non-flow policy, or
    `eta_star`/`equilibrium`/`step_weights` of the wrong shape.
    """
    runs = _Runs(batch, policy, equilibrium, eta_star, step_weights, config)
    check_search_range(config.search_range, "WorstCaseSearch.search_range")
    res = _bracket(runs)
    scale = _scale(runs.N_star)
    out = []
    for b in range(runs.B):
        rec: dict = dict.fromkeys(RECORD_KEYS)
        if not runs.usable[b]:
            out.append(rec)
            continue
        es = float(runs.eta_star[b])
        cens = str(res.censoring[b])
        lo, hi = (None if math.isnan(v) else float(v) for v in (res.lo[b], res.hi[b]))
        rec.update(
            eta_global_bracket=[lo, hi],
            eta_global_censoring=cens,
            eta_global=hi if cens == "bracketed" else None,
            eta_global_search={"steps": int(res.steps[b]), "rejected": int(res.rejected[b])},
        )
        if cens == "above_range":
            rec["bistable"] = False
        if res.witness[b] is not None:
            found, p = res.witness[b]
            amp, per = float(found.amplitude[p, b]), float(found.period[p, b])
            rec["witness"] = _witness(found.N[p, b], found.x[p, b], int(runs.cells[b]), amp, per)
            rec["cycle_amplitude"], rec["cycle_period"] = amp, per
            assert hi is not None
            rec["bistable"] = hi < es
            jump = amp >= config.onset_amplitude * scale[b]
            rec["hopf"] = "subcritical" if hi < es or jump else "supercritical"
        out.append(rec)
    return out


RECORD_KEYS = ("eta_global_bracket", "eta_global_censoring", "eta_global", "bistable", "hopf",
               "witness", "cycle_amplitude", "cycle_period", "eta_global_search")  # fmt: skip
"""The keys of each scenario's dict from `global_threshold`."""
