"""The global step-size threshold $\\eta_g$ of flow routing, found by a batched search.

$\\eta^*$ (`batch_critical_step_size`) is where the linearisation at the equilibrium loses
stability; below it the equilibrium attracts the starts near it, not necessarily all of
them. When the Hopf bifurcation at $\\eta^*$ is subcritical, a large stable limit cycle
coexists with the stable equilibrium on a band of step sizes below $\\eta^*$, and only some
starts find it. This module searches for such starts (theory/global_threshold.md):

* a geometric ladder of steps $\\eta^*r^k$ ($r \\le 1.05$, $k = -K, \\dots, -1$ below and
  $k = 1, \\dots$ above $\\eta^*$);
* at every rung, the same starts $(N(0), x(0))$ per scenario: cold vertex starts (every
  router on one corner of its simplex, $N = 0$) and random ones (uniform $N(0)$, Dirichlet
  $x(0)$). The model's history before $t = 0$ is constant and equal to the start (the
  simulator holds $N(t) = N(0)$ and $x(t) = x(0)$ for $t < 0$), so a start is the pair
  $(N(0), x(0))$ and nothing else;
* optionally refined by projected, normalised gradient ascent on the late-window mean of
  $\\sum_jD_j$ over a short horizon, differentiated through the simulator's own tick
  (`jax.grad`, checkpointed segments);
* every (rung, start, scenario) advanced as one vmapped batch through the simulator's
  tick, accumulating late-window statistics instead of saving trajectories;
* a run is *non-decaying* when its workload gap does not fall between the two halves of
  the late window (the third and the last quarter of the horizon by default; "quarter"
  below means such a half) and its last-quarter peak-to-peak workload is not small
  (`non_decaying`); $\\eta_g$ is the rung just below the lowest rung with a non-decaying
  start.
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
from .config import WorstCaseSearch
from .stats import _ascend, _late_stats, _scale, _with_start, non_decaying, sustained


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


def _witness(N0: np.ndarray, x0: np.ndarray, n: int) -> dict:
    """A start in the scenario file's `initial` form (the scenario's own `n` cells)."""
    x = np.clip(x0[:n, :n], 0.0, None)
    tot = x.sum(axis=-1, keepdims=True)
    x = np.where(tot > 0, x / np.where(tot > 0, tot, 1.0), 0.0)
    return {
        "workload": [float(v) for v in np.clip(N0[:n], 0.0, None)],
        "routing": [[float(v) for v in row] for row in x],
    }


class _Search(NamedTuple):
    """The search's arrays (host side), indexed `[rung, start, scenario, ...]`."""

    ladder: np.ndarray  # (R, B) step of each rung
    exponents: np.ndarray  # (R,) k of each rung
    usable: np.ndarray  # (B,) eta* finite and positive
    non_decaying: np.ndarray  # (R, S, B)
    sustained: np.ndarray  # (R, S, B)
    scale: np.ndarray  # (B,) max_j N*_j
    success: np.ndarray  # (R, S, B)
    gap3: np.ndarray
    gap4: np.ndarray
    amp3: np.ndarray
    amp4: np.ndarray
    period: np.ndarray
    N0: np.ndarray  # (R, S, B, n) the starts as run (after any ascent)
    x0: np.ndarray  # (R, S, B, n, n)
    cells: np.ndarray  # (B,) real cells


def _search(batch: Scenario, policy, equilibrium, eta_star, config: WorstCaseSearch) -> _Search:
    pol = _flow_policy(policy)
    require_x64("global_threshold")
    if not isinstance(config, WorstCaseSearch):
        raise ValueError(f"config = {config!r} is invalid: expected a WorstCaseSearch")
    if len(batch.batch_shape) != 1:
        raise ValueError(
            f"batch has batch shape {batch.batch_shape}: expected one batch axis (stack_scenarios)"
        )
    B, n = batch.batch_shape[0], batch.n_cells
    es = np.asarray(eta_star, dtype=float)
    if es.shape != (B,):
        raise ValueError(f"eta_star has shape {es.shape}: expected ({B},), one per scenario")
    N_star = np.asarray(equilibrium.N, dtype=float)
    if N_star.shape != (B, n):
        raise ValueError(f"equilibrium.N has shape {N_star.shape}: expected ({B}, {n})")
    T, h = float(config.horizon), float(config.tick)
    K = int(round(T / h))
    late = max(int(round(config.late_window * K)), 2)
    usable = np.isfinite(es) & (es > 0) & np.all(np.isfinite(N_star), axis=-1)
    ks = config.rungs()
    R, S = len(ks), config.starts
    ladder = np.where(usable, es, 1.0)[None, :] * float(config.ladder_ratio) ** ks[:, None]

    scn = batch.strip()
    scn = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
    )
    N0, x0 = _starts(scn, N_star, config)
    flat_scn = _flat(scn, R, S)
    eta = jnp.asarray(np.broadcast_to(ladder[:, None, :, None], (R, S, B, n)).reshape(-1, n))
    Ns = _flat(jnp.asarray(N_star), R, S)
    N0f = jnp.asarray(np.broadcast_to(N0, (R,) + N0.shape).reshape(-1, n))
    x0f = jnp.asarray(np.broadcast_to(x0, (R,) + x0.shape).reshape(-1, n, n))
    tau = np.where(np.asarray(scn.allowed), np.asarray(scn.latency), 0.0)
    hist = _hist_len(float(tau.max() / h))
    window = _window_width(
        np.asarray(scn.arrival_times), float(tau.max() + 2.0 * h), np.asarray(scn.arrival_rates)
    )
    integrator = Fast().for_batch(scn, h).prepared(jnp.float64)
    hj = jnp.asarray(h, jnp.float64)
    if config.ascent_steps:
        Ka = int(round(config.ascent_horizon / h))
        N0f, x0f, _ = _ascend(
            flat_scn, eta, hj, Ns, N0f, x0f, pol, integrator,
            jnp.asarray(config.ascent_rate, jnp.float64),
            K=Ka, steps=config.ascent_steps, hist=hist, window=window,
        )  # fmt: skip
    # Split the runs over this process's devices (one per core after `use_cpu_cores`),
    # the last run repeated to fill the last device's share.
    M = R * S * B
    ndev = jax.local_device_count()
    pad = (-M) % ndev
    runs = (_with_start(flat_scn, N0f, x0f), eta, Ns)
    if pad:
        runs = jax.tree_util.tree_map(
            lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], pad, axis=0)]), runs
        )
    marks = np.array([K - late, K - late // 2, K])
    ticks = (jnp.full((M + pad,), h), jnp.asarray(np.broadcast_to(marks, (M + pad, 3))))
    (scn_r, eta_r, Ns_r), (h_r, K_r) = shard_batch((runs, ticks))
    chunk = _chosen_chunk(None, n, (M + pad) // ndev)
    stats = _late_stats(
        scn_r, eta_r, Ns_r, h_r, K_r, pol, integrator, hist=hist, window=window, chunk=chunk
    )
    stats = jax.tree_util.tree_map(lambda a: np.asarray(a)[:M], stats)
    shape = (R, S, B)
    return _Search(
        ladder=ladder,
        exponents=ks,
        usable=usable,
        non_decaying=non_decaying(stats, Ns, config).reshape(shape),
        sustained=sustained(stats, config).reshape(shape),
        scale=_scale(N_star),
        success=(np.asarray(stats.status) == int(RESULTS.success)).reshape(shape),
        gap3=np.asarray(stats.gap3).reshape(shape),
        gap4=np.asarray(stats.gap4).reshape(shape),
        amp3=np.asarray(stats.amp3).reshape(shape),
        amp4=np.asarray(stats.amp4).reshape(shape),
        period=np.asarray(stats.period).reshape(shape),
        N0=np.asarray(N0f).reshape(shape + (n,)),
        x0=np.asarray(x0f).reshape(shape + (n, n)),
        cells=np.asarray(scn.cell_mask).sum(axis=-1),
    )


def global_threshold(
    batch: Scenario,
    policy,
    equilibrium,
    eta_star,
    *,
    config: WorstCaseSearch = WorstCaseSearch(),
) -> list[dict]:
    """The global threshold $\\eta_g$ of flow routing for every scenario of a batch.

    $\\eta_g = \\eta^*r^{k_c - 1}$, $k_c$ the lowest rung of the ladder $\\eta^*r^k$
    ($k = -K..-1, 1..$; `WorstCaseSearch`) at which some start leads to a non-decaying run
    (`non_decaying`): the largest rung below which every rung's every start decays.
    All rungs $\\times$ starts $\\times$ scenarios run as one vmapped batch through the
    simulator's tick (module docstring; theory/global_threshold.md).

    **Arguments:**
    - `batch`: scenarios from `stack_scenarios` (leading axis `B`), constant arrival rates.
    - `policy`: a flow policy name (`"flow-grad"`, ...) or `FlowRouting`.
    - `equilibrium`: its cost's equilibria, batched `N` `(B, n)` (`solve_equilibrium`).
    - `eta_star`: `(B,)` linear critical steps $\\eta^*$ (`batch_critical_step_size`);
      a scenario whose $\\eta^*$ is not finite and positive gets every field `None`.
    - `config`: a `WorstCaseSearch`.

    **Returns:** one dict per scenario with exactly the keys
    - `eta_global`: $\\eta_g$ (`None` when the lowest rung already has a non-decaying
      start: $\\eta_g < \\eta^*r^{-K}$; then `bistable` is True);
    - `bistable`: $\\eta_g < \\eta^*$ (a non-decaying start below $\\eta^*$);
    - `hopf`: `"subcritical"` when a cycle was found below $\\eta^*$; when the lowest rung
      with one is the first rung above $\\eta^*$, `"subcritical"` if the sustained
      oscillation there is at least `onset_amplitude` $\\times\\bar N$ (a finite jump at
      onset), else `"supercritical"` (a branch growing from zero); `None` otherwise (no
      cycle on the ladder, or none before the second rung above);
    - `witness`: `{"workload": [...], "routing": [[...]]}`, the start with the largest
      last-quarter gap among the non-decaying runs at rung $k_c$ (`None` without one), in
      the scenario file's `initial` form;
    - `cycle_amplitude`, `cycle_period`: that run's last-quarter peak-to-peak workload
      (largest over cells) and period (`WorkloadStats`), `None` without a witness (the
      period also when it crossed its mid-range fewer than twice).

    **Raises:** `ValueError` for a batch without one batch axis, a non-flow policy, or
    `eta_star`/`equilibrium` of the wrong shape.
    """
    res = _search(batch, policy, equilibrium, eta_star, config)
    ladder, ks, bad, ok = res.ladder, res.exponents, res.non_decaying, res.success
    above = np.flatnonzero(ks == 1)
    out = []
    for b in range(ladder.shape[1]):
        rec: dict = dict.fromkeys(
            ("eta_global", "bistable", "hopf", "witness", "cycle_amplitude", "cycle_period")
        )
        if not res.usable[b]:
            out.append(rec)
            continue
        # The onset amplitude: the largest sustained oscillation at the first rung above.
        onset = None
        if above.size:
            keep = res.sustained[above[0], :, b] & ok[above[0], :, b]
            if keep.any():
                onset = float(np.max(res.amp4[above[0], keep, b]))
        hit = np.flatnonzero(bad[:, :, b].any(axis=1))
        if hit.size == 0:
            rec.update(eta_global=float(ladder[-1, b]), bistable=False)
            out.append(rec)
            continue
        c = int(hit[0])
        rec["eta_global"] = float(ladder[c - 1, b]) if c > 0 else None
        rec["bistable"] = bool(ks[c] < 0)
        if ks[c] < 0:
            rec["hopf"] = "subcritical"
        elif onset is not None and ks[c] == 1:
            jump = onset >= config.onset_amplitude * res.scale[b]
            rec["hopf"] = "subcritical" if jump else "supercritical"
        cand = bad[c, :, b] & ok[c, :, b]
        if cand.any():
            s = int(np.argmax(np.where(cand, res.gap4[c, :, b], -np.inf)))
            rec["witness"] = _witness(res.N0[c, s, b], res.x0[c, s, b], int(res.cells[b]))
            rec["cycle_amplitude"] = float(res.amp4[c, s, b])
            p = float(res.period[c, s, b])
            rec["cycle_period"] = p if math.isfinite(p) else None
        out.append(rec)
    return out
