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

import dataclasses
import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._devices import per_device, shard_batch
from ._integrators import Fast
from ._lyapunov import workload_gap
from ._precision import require_x64
from ._projection import project_simplex
from ._results import RESULTS
from ._scenario import Scenario
from ._simulate import (
    _chosen_chunk,
    _chunked,
    _hist_len,
    _init_state,
    _setup,
    _tick,
    _window_width,
)
from ._stability import _flow_policy

__all__ = ["WorkloadStats", "WorstCaseSearch", "global_threshold", "non_decaying"]

HOPF = ("subcritical", "supercritical")
"""The values of `hopf` (or `None` when no cycle was found on the ladder)."""


class WorstCaseSearch(eqx.Module):
    """Configuration of `global_threshold`.

    **Fields:**
    - `starts`: starts per scenario (the same at every rung): `vertex_starts` cold vertex
      starts, the rest random.
    - `vertex_starts`: starts with $N(0) = 0$ and every router on one corner of its simplex
      (start $v$ puts router $i$ on its $(v \\bmod m_i)$-th allowed arc; start 0 is "all
      routing to the first allowed cell"). At most `starts`.
    - `ladder_ratio`: $r$, the ratio between rungs, in $(1, 1.05]$.
    - `rungs_below`, `rungs_above`: $K$ rungs $\\eta^*r^{-K}, \\dots, \\eta^*r^{-1}$ and
      rungs $\\eta^*r, \\dots$ above. $\\eta^*$ itself is not a rung: there the
      linearisation is neutral and a decaying run decays only algebraically. The default
      8 reaches $0.68\\eta^*$ at $r = 1.05$: measured $\\eta_g/\\eta^*$ on the symmetric
      pair is 0.86, 0.82, 0.68 and 0.53 at $\\tau$ = 0.25, 0.5, 1 and 2
      (notebooks/stepsize_delay_tradeoff.ipynb), so longer delays need more rungs (14 for
      $\\tau = 2$); a search whose lowest rung already fails reports `eta_global` None
      (below the ladder), never a value.
    - `horizon`, `tick`: $T$ and $h$ of every run (`horizon` a whole number of ticks).
    - `late_window`: the fraction of the horizon at its end whose two halves the decay
      test compares (`non_decaying`); 0.5: the third and the last quarter.
    - `workload_scale`: random $N_j(0) \\sim U[0, s(1 + N_j^*)]$.
    - `dirichlet`: the concentration of random routings (below 1 favours faces).
    - `decay_ratio`: a run decays when its last-quarter mean gap is below this fraction of
      the third quarter's (`non_decaying`).
    - `amplitude_tol`: a run decays when its last-quarter peak-to-peak workload is below
      this times $\\bar N = \\max_jN_j^*$.
    - `onset_amplitude`: with no cycle below $\\eta^*$, the Hopf bifurcation counts as
      subcritical when the sustained oscillation at the first rung above $\\eta^*$ is at
      least this times $\\bar N$ (a supercritical branch starts from zero amplitude,
      $A \\propto \\sqrt{\\eta/\\eta^* - 1}$; a subcritical one jumps to a finite cycle).
    - `ascent_steps`: gradient-ascent refinements of every start (0: none).
    - `ascent_horizon`: the horizon of the ascent objective (its late window is the last
      half).
    - `ascent_rate`: the step of the normalised ascent, as a fraction of $1 + N_j^*$ for
      workloads and of the simplex for routings.
    - `seed`: the random starts' seed.
    """

    starts: int = 16
    vertex_starts: int = 2
    ladder_ratio: float = 1.05
    rungs_below: int = 8
    rungs_above: int = 1
    horizon: float = 300.0
    tick: float = 0.05
    late_window: float = 0.5
    workload_scale: float = 3.0
    dirichlet: float = 0.5
    decay_ratio: float = 0.8
    amplitude_tol: float = 0.01
    onset_amplitude: float = 0.25
    ascent_steps: int = 0
    ascent_horizon: float = 40.0
    ascent_rate: float = 0.25
    seed: int = 0

    def __check_init__(self):
        def bad(name, allowed):
            return ValueError(
                f"WorstCaseSearch.{name} = {getattr(self, name)!r} is invalid: expected {allowed}"
            )

        for name, lo in (("starts", 1), ("vertex_starts", 0), ("rungs_below", 1),
                         ("rungs_above", 0), ("ascent_steps", 0), ("seed", 0)):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise bad(name, f"an integer >= {lo}")
        if self.vertex_starts > self.starts:
            raise bad("vertex_starts", f"an integer <= starts = {self.starts}")
        r = self.ladder_ratio
        if not (isinstance(r, (int, float)) and 1.0 < r <= 1.05):
            raise bad("ladder_ratio", "a number in (1, 1.05]")
        for name in ("horizon", "tick", "workload_scale", "dirichlet", "ascent_horizon",
                     "ascent_rate", "amplitude_tol", "onset_amplitude"):  # fmt: skip
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise bad(name, "a finite number > 0")
        if not (isinstance(self.decay_ratio, (int, float)) and 0.0 < self.decay_ratio < 1.0):
            raise bad("decay_ratio", "a number in (0, 1)")
        if not (isinstance(self.late_window, (int, float)) and 0.0 < self.late_window <= 1.0):
            raise bad("late_window", "a number in (0, 1]")
        for name in ("horizon", "ascent_horizon"):
            K = getattr(self, name) / self.tick
            if abs(K - round(K)) > 1e-9 * max(K, 1.0) or round(K) < 8:
                raise bad(name, f"a whole number (>= 8) of ticks of {self.tick}")

    def rungs(self) -> np.ndarray:
        """The exponents $k$ of the ladder, ascending ($0$ excluded)."""
        return np.array(
            list(range(-self.rungs_below, 0)) + list(range(1, self.rungs_above + 1)), dtype=int
        )


class WorkloadStats(eqx.Module):
    """Late-window statistics of one run (arrays over the flattened batch).

    **Fields:**
    - `gap3`, `gap4`: mean of $\\sum_jD_j(N(t))$ (`workload_gap`) over the first and the
      second half of the late window (`WorstCaseSearch.late_window`; by default the third
      and the last quarter of the horizon), sampled at every tick.
    - `amp3`, `amp4`: peak-to-peak of $N_j$ over those quarters, largest over cells.
    - `period`: the mean time between upward crossings, in the last quarter, of the
      mid-range of the third quarter by the workload of the cell with the largest `amp4`
      (`nan` with fewer than two crossings).
    - `status`: the simulator's `RESULTS` code.
    - `final_N`, `final_x`: the state at $T$.
    """

    gap3: jax.Array
    gap4: jax.Array
    amp3: jax.Array
    amp4: jax.Array
    period: jax.Array
    status: jax.Array
    final_N: jax.Array
    final_x: jax.Array


def _scale(N_star) -> np.ndarray:
    """$\\bar N = \\max_jN^*_j$ (floored at $10^{-9}$), the workload scale of a scenario."""
    return np.maximum(np.max(np.asarray(N_star), axis=-1), 1e-9)


def sustained(stats: WorkloadStats, config: WorstCaseSearch) -> np.ndarray:
    """$\\bar G_4 \\ge \\rho\\,\\bar G_3$ with $\\bar G_q$ the mean workload gap over quarter $q$
    of the horizon and $\\rho$ = `decay_ratio`: the gap did not fall between the last two
    quarters."""
    return np.asarray(stats.gap4) >= config.decay_ratio * np.asarray(stats.gap3)


def non_decaying(stats: WorkloadStats, N_star, config: WorstCaseSearch) -> np.ndarray:
    """Whether each run is *non-decaying*: it succeeded numerically, it is `sustained`
    ($\\bar G_4 \\ge \\rho\\,\\bar G_3$) and $A_4 \\ge a\\bar N$, with $A_4$ the last quarter's
    largest peak-to-peak workload, $\\bar N = \\max_jN^*_j$, $a$ = `amplitude_tol`.

    A converging run loses gap between the quarters (a linear decay rate $\\sigma$ of the
    workloads gives $\\bar G_4/\\bar G_3 \\approx e^{-\\sigma T/2}$) or has already reached the
    equilibrium (tiny $A_4$, where the ratio of two rounding-level gaps means nothing); a
    limit cycle keeps both. Both are averages and extremes over many ticks, so they do not
    move with the tick once it resolves the cycle (theory/global_threshold.md). A run whose
    status is not `success` counts as non-decaying for the threshold (nothing shows that it
    decays) but is never a witness (`global_threshold`).
    """
    ok = np.asarray(stats.status) == int(RESULTS.success)
    big = np.asarray(stats.amp4) >= config.amplitude_tol * _scale(N_star)
    return ~ok | (sustained(stats, config) & big)


# ----------------------------------------------------------------------------------------
# The batched runs: the simulator's tick, vmapped, with statistics instead of saves
# ----------------------------------------------------------------------------------------


def _with_start(scn: Scenario, N0, x0) -> Scenario:
    return dataclasses.replace(scn, initial_workload=N0, initial_routing=x0)


def _gap(cost, scn, N, N_star):
    return jnp.sum(workload_gap(cost, scn, N, N_star), axis=-1)


def _late_stats_chunk(scn, eta, N_star, h_b, K_b, *, policy, integrator, hist, window):
    """`WorkloadStats` of one chunk of runs (`_late_stats`); `h_b` `(M,)` and `K_b`
    `(M, 3)` hold the batch's common tick and its tick marks $(K_2, K_3, K)$: the late
    window $[K_2, K]$ and its halves $[K_2, K_3]$, $[K_3, K]$."""
    h, (q2, q3, K) = h_b[0], K_b[0]
    M, n = eta.shape
    dtype = eta.dtype
    hh = jnp.full((M,), h, dtype)
    setup = jax.vmap(lambda s, e, t: _setup(s, e, t, hist))(scn, eta, hh)
    aux = jax.vmap(lambda s, t: policy.prepare(s, t, 0.0))(scn, hh)
    init = functools.partial(_init_state, policy=policy, width=window)
    state = jax.vmap(init)(scn, setup, aux)
    tick = jax.vmap(
        functools.partial(_tick, policy=policy, integrator=integrator, window=window),
        in_axes=(0, 0, 0, None, 0),
    )
    gap = jax.vmap(functools.partial(_gap, policy.cost))
    mask = scn.cell_mask

    def advance(k0, k1, carry, update):
        def body(k, c):
            st, acc = c
            new = tick(scn, setup, st, k, aux)
            return new, update(acc, st.N, new.N, k)

        return jax.lax.fori_loop(k0, k1, body, carry)

    state, _ = advance(0, q2, (state, ()), lambda acc, *_: acc)
    big = jnp.full((M, n), jnp.inf, dtype)
    zero = jnp.zeros((M,), dtype)

    def quarter3(acc, N_old, N_new, k):
        g, lo, hi = acc
        return g + gap(scn, N_new, N_star), jnp.minimum(lo, N_new), jnp.maximum(hi, N_new)

    state, (g3, lo3, hi3) = advance(q2, q3, (state, (zero, big, -big)), quarter3)
    level = 0.5 * (lo3 + hi3)

    def quarter4(acc, N_old, N_new, k):
        g, lo, hi, ups, first, last = acc
        up = (N_old < level) & (N_new >= level)
        frac = (level - N_old) / jnp.where(up, N_new - N_old, 1.0)
        t_cross = (k.astype(dtype) + frac) * h
        first = jnp.where(up & (ups == 0), t_cross, first)
        last = jnp.where(up, t_cross, last)
        return (
            g + gap(scn, N_new, N_star),
            jnp.minimum(lo, N_new),
            jnp.maximum(hi, N_new),
            ups + up.astype(jnp.int32),
            first,
            last,
        )

    nan = jnp.full((M, n), jnp.nan, dtype)
    acc4 = (zero, big, -big, jnp.zeros((M, n), jnp.int32), nan, nan)
    state, (g4, lo4, hi4, ups, first, last) = advance(q3, K, (state, acc4), quarter4)

    def amplitude(lo, hi):
        return jnp.where(mask, hi - lo, 0.0)

    a3, a4 = amplitude(lo3, hi3), amplitude(lo4, hi4)
    top = jnp.argmax(a4, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, top[:, None], axis=-1)[:, 0]  # noqa: E731
    n_up = pick(ups)
    period = jnp.where(n_up >= 2, (pick(last) - pick(first)) / jnp.maximum(n_up - 1, 1), jnp.nan)
    return WorkloadStats(
        gap3=g3 / (q3 - q2),
        gap4=g4 / (K - q3),
        amp3=jnp.max(a3, axis=-1),
        amp4=jnp.max(a4, axis=-1),
        period=period,
        status=state.status,
        final_N=state.N,
        final_x=state.x,
    )


def _late_stats_impl(scn, eta, N_star, h_b, K_b, *, chunk, **static):
    return _chunked(functools.partial(_late_stats_chunk, **static), chunk)(
        scn, eta, N_star, h_b, K_b
    )


@eqx.filter_jit
def _late_stats(scn, eta, N_star, h_b, K_b, policy, integrator, *, hist, window, chunk):
    """`WorkloadStats` of every run of the flattened batch (`scn`, `eta` `(M, n)`, `N_star`
    `(M, n)`, the common tick and tick marks repeated in `h_b` `(M,)`, `K_b` `(M, 3)`; traced,
    so one compilation serves every horizon). As `simulate` runs a batch whose scenarios
    share their ticks: each device runs its share (`per_device`), in chunks of `chunk`
    runs one after the other (`_chunked`: on a CPU a chunk's tick stays in cache), with
    one vmapped tick per pass of a loop whose bounds are scalars."""
    impl = functools.partial(
        _late_stats_impl, policy=policy, integrator=integrator, hist=hist, window=window,
        chunk=chunk,
    )  # fmt: skip
    return per_device(impl)(scn, eta, N_star, h_b, K_b)


@eqx.filter_jit
def _ascend(scn, eta, h, N_star, N0, x0, policy, integrator, rate, *, K, steps, hist, window):
    """`steps` projected, normalised gradient-ascent steps on
    $J(N_0, x_0) = \\frac{2}{K}\\sum_{k > K/2}\\sum_jD_j(N(t_k))$ for every run of the batch,
    keeping each run's best start: `(N0, x0, history)`, `history` `(steps, M)` the objective
    at each iterate (row 0: the starts' own; $-\\infty$ for a failed run). The tick loop is a scan of checkpointed segments of
    about $\\sqrt K$ ticks (memory for $2\\sqrt K$ states instead of $K$)."""
    M, n = eta.shape
    dtype = eta.dtype
    hh = jnp.full((M,), h, dtype)
    setup = jax.vmap(lambda s, e, t: _setup(s, e, t, hist))(scn, eta, hh)
    tick = jax.vmap(
        functools.partial(_tick, policy=policy, integrator=integrator, window=window),
        in_axes=(0, 0, 0, None, 0),
    )
    gap = jax.vmap(functools.partial(_gap, policy.cost))
    L = max(int(math.isqrt(K)), 1)
    S = -(-K // L)
    half = K // 2

    def objective(N0, x0):
        s = _with_start(scn, N0, x0)
        aux = jax.vmap(lambda a, t: policy.prepare(a, t, 0.0))(s, hh)
        init = functools.partial(_init_state, policy=policy, width=window)
        state = jax.vmap(init)(s, setup, aux)

        @jax.checkpoint
        def segment(carry, seg):
            def one(c, j):
                st, acc = c
                k = seg * L + j
                new = tick(s, setup, st, k, aux)
                w = ((k + 1 > half) & (k < K)).astype(dtype)
                # (ticks past K, the last segment's padding, neither count nor advance)
                keep = k < K
                new = jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), new, st)
                return (new, acc + w * gap(s, new.N, N_star)), None

            return jax.lax.scan(one, carry, jnp.arange(L, dtype=jnp.int32))[0], None

        (final, acc), _ = jax.lax.scan(
            segment, (state, jnp.zeros((M,), dtype)), jnp.arange(S, dtype=jnp.int32)
        )
        J = acc / (K - half)
        ok = final.status == RESULTS.success
        return jnp.sum(jnp.where(ok, J, 0.0)), jnp.where(ok, J, -jnp.inf)

    grad = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)
    scale = 1.0 + N_star
    mask = scn.cell_mask
    allowed = scn.allowed

    def step(carry, _):
        N, x, best_J, best_N, best_x = carry
        (_, J), (gN, gx) = grad(N, x)
        better = J > best_J
        best_J = jnp.where(better, J, best_J)
        best_N = jnp.where(better[:, None], N, best_N)
        best_x = jnp.where(better[:, None, None], x, best_x)
        gN = jnp.where(mask & jnp.isfinite(gN), gN * scale, 0.0)
        gx = jnp.where(allowed & jnp.isfinite(gx), gx, 0.0)
        nN = jnp.max(jnp.abs(gN), axis=-1, keepdims=True)
        nx = jnp.max(jnp.abs(gx), axis=(-2, -1), keepdims=True)
        N = jnp.where(mask, jnp.maximum(N + rate * scale * gN / jnp.maximum(nN, 1e-300), 0.0), 0.0)
        x = project_simplex(x + rate * gx / jnp.maximum(nx, 1e-300), allowed)
        x = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), x, 0.0)
        return (N, x, best_J, best_N, best_x), J

    minus = jnp.full((M,), -jnp.inf, dtype)
    (N, x, best_J, best_N, best_x), history = jax.lax.scan(
        step, (N0, x0, minus, N0, x0), None, length=steps
    )
    # (the last iterate's value is not known without one more pass: the best seen is kept)
    return best_N, best_x, history


# ----------------------------------------------------------------------------------------
# Starts and the search
# ----------------------------------------------------------------------------------------


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
