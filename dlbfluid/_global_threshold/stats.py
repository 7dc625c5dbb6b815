"""Late-window statistics of a batch of runs (`WorkloadStats`), the decay test
(`non_decaying`), and the batched tick loop with its gradient ascent on the starts."""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._policies.projection import project_simplex
from .._results import RESULTS
from .._runtime.devices import per_device
from .._scenario import Scenario
from .._simulate import (
    _chunked,
    _init_state,
    _setup,
    _tick,
)
from .._theorem1.lyapunov import workload_gap
from .config import WorstCaseSearch


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
