"""Lyapunov diagnostics of flow routing and the shape of Theorem 1 (seed §4.1, App. C.3).

All quantities are reconstructed from the seed's words in theory/lyapunov.md.
Fix an equilibrium $(N^*, x^*)$ of the cost family and write $f_j^* = f_j(N_j^*)$,
$c_{ij}^* = f_j^* + g_{ij}$. Along a trajectory:

* routing component $R = \\sum_i \\frac{\\lambda_i}{2\\eta_i}\\|x_i - x_i^*\\|^2$;
* workload component $\\Phi = \\sum_j \\int_{N_j^*}^{N_j}(f_j(s) - f_j^*)\\,ds$;
* workload gap $D_j = (f_j(N_j) - f_j^*)(\\mu_j(N_j) - \\mu_j(N_j^*)) \\ge 0$;
* slackness error $S_i = \\sum_j (x_{ij} - x_{ij}^*)c_{ij}^* \\ge 0$ and its mixed-delay
  version $S_i^\\tau = \\sum_j (x_{ij}(t-\\tau_{ij}) - x_{ij}^*)c_{ij}^*$;
* delay mismatch $\\Gamma_{ij} = (x_{ij}(t-\\tau_{ij}) - x_{ij}^*)c_{ij}(N_j(t)) -
  (x_{ij}(t) - x_{ij}^*)c_{ij}(N_j(t-\\tau_{ij}))$,

with the drift inequality $\\frac{d}{dt}[R + \\Phi] \\le -\\sum_j D_j - \\sum_i \\lambda_i S_i^\\tau
+ \\sum_{ij}\\lambda_i\\Gamma_{ij}$ for the continuous-time dynamics.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._costs import cost_from_name
from .._scenario import Scenario
from .._shapes import lead, like

# 32-point Gauss-Legendre rule on [0, 1] for Phi (f is smooth; exact for RIF).
_GL_X, _GL_W = np.polynomial.legendre.leggauss(32)
_GL_X = 0.5 * (_GL_X + 1.0)
_GL_W = 0.5 * _GL_W


def workload_potential_per_cell(cost, scn: Scenario, N, N_star):
    """$\\Phi_j(N_j) = \\int_{N_j^*}^{N_j} (f_j(s) - f_j^*)\\,ds$ per cell (Gauss-Legendre, 32
    nodes; 0 on padded cells)."""
    cost = cost_from_name(cost)
    N, N_star = jnp.broadcast_arrays(N, N_star)
    f_star = cost.destination(scn, N_star)
    s = N_star[..., None, :] + lead(_GL_X[:, None], N.ndim + 1) * (N - N_star)[..., None, :]
    integrand = cost.destination(scn, s) - f_star[..., None, :]
    per_cell = (N - N_star) * jnp.tensordot(_GL_W, integrand, axes=(0, -2))
    return jnp.where(like(scn.cell_mask, per_cell), per_cell, 0.0)


def workload_potential(cost, scn: Scenario, N, N_star):
    """$\\Phi(N) = \\sum_j \\int_{N_j^*}^{N_j} (f_j(s) - f_j^*)\\,ds$ (Gauss-Legendre, 32 nodes)."""
    return jnp.sum(workload_potential_per_cell(cost, scn, N, N_star), axis=-1)


def workload_gap(cost, scn: Scenario, N, N_star):
    """$D_j(N) = (f_j(N_j) - f_j^*)(\\mu_j(N_j) - \\mu_j(N_j^*))$, per cell."""
    cost = cost_from_name(cost)
    N, N_star = jnp.broadcast_arrays(N, N_star)
    df = cost.destination(scn, N) - cost.destination(scn, N_star)
    dmu = scn.service.rate(N) - scn.service.rate(N_star)
    return jnp.where(like(scn.cell_mask, df), df * dmu, 0.0)


class Diagnostics(eqx.Module):
    """Per-save Lyapunov quantities of one trajectory (arrays over the save axis).

    **Fields:** `t`; `R`, `Phi` (the two components); `gap` ($\\sum_j D_j$);
    `slack` ($\\sum_i\\lambda_iS_i$); `slack_delayed` ($\\sum_i\\lambda_iS_i^\\tau$);
    `mismatch` ($\\sum_{ij}\\lambda_i\\Gamma_{ij}$); `time_average_distance`
    ($\\frac1t\\int_0^t\\sum_jD_j$); `time_average_distance_with_slack`
    ($\\frac1t\\int_0^t[\\sum_jD_j + \\sum_i\\lambda_iS_i]$); `drift_excess`
    ($[R+\\Phi]_0^t - \\int_0^t(-\\sum D - \\sum\\lambda S^\\tau + \\sum\\lambda\\Gamma)$, which the
    continuous dynamics keep $\\le 0$; positive values measure the discretisation error).
    """

    t: Float[Array, " S"]
    R: Float[Array, " S"]
    Phi: Float[Array, " S"]
    gap: Float[Array, " S"]
    slack: Float[Array, " S"]
    slack_delayed: Float[Array, " S"]
    mismatch: Float[Array, " S"]
    time_average_distance: Float[Array, " S"]
    time_average_distance_with_slack: Float[Array, " S"]
    drift_excess: Float[Array, " S"]


def _split_delay(tau, h):
    """`(m, r)` with $\\tau = mh + r$, $0 \\le r < h$, each with a leading unit axis (the
    whole ticks of every delay and the remainder; shared by `_delayed` and `_tick_pairs`)."""
    m = jnp.floor(tau / h + 1e-9).astype(jnp.int32)[None]
    return m, jnp.maximum(tau - m[0] * h, 0.0)[None]


def _delayed(arr, h, tau, idx, *, piecewise_constant: bool):
    """Values at $t_k - \\tau_{ij}$ from per-tick saves `arr[k]` (history = `arr[0]`).

    Routing is piecewise constant: $x(t_k - \\tau) = x^{q}$ with $q = \\lceil k - \\tau/h\\rceil$
    written as $k - m - [r > 0]$; workloads are interpolated linearly between ticks.
    """
    m, r = _split_delay(tau, h)
    k = idx[:, None, None]
    if piecewise_constant:
        q = jnp.maximum(k - m - (r > 0), 0)
        return arr[q, jnp.arange(tau.shape[0])[:, None], jnp.arange(tau.shape[1])[None, :]]
    lo = jnp.maximum(k - m - 1, 0)
    hi = jnp.maximum(k - m, 0)
    w = jnp.where(k - m - 1 < 0, 1.0, 1.0 - r / h)  # weight of `hi`
    col = jnp.arange(tau.shape[1])[None, :]
    return (1.0 - w) * arr[lo, col] + w * arr[hi, col]


def _tick_pairs(dx, tau, h):
    """The delayed routings in force during each tick, in the tick model's pairing.

    With $\\tau_{ij} = m_{ij}h + r_{ij}$ ($0 \\le r < h$), tick $k$ ($k = 0..K-1$) carries
    $x^{k-m-1}$ on $[t_k, t_k + r)$ and $x^{k-m}$ on $[t_k + r, t_{k+1})$, $x^0$ before 0
    (theory/discretisation.md). Returns `(prev, cur, r)`: `(K, n, n)` entries of the
    per-tick saves `dx` (`(K+1, n, n)`) and the `(1, n, n)` remainders. The projection check
    and Theorem 1's `mixed_delay` estimate both integrate against this pairing.
    """
    K = dx.shape[0] - 1
    m, r = _split_delay(tau, h)
    k = jnp.arange(K)[:, None, None]
    rows = jnp.arange(tau.shape[0])[None, :, None]
    cols = jnp.arange(tau.shape[1])[None, None, :]
    prev = dx[jnp.maximum(k - m - 1, 0), rows, cols]
    cur = dx[jnp.maximum(k - m, 0), rows, cols]
    return prev, cur, r


def _cumtrapz(y, t):
    inc = 0.5 * (y[1:] + y[:-1]) * jnp.diff(t)
    return jnp.concatenate([jnp.zeros(1, y.dtype), jnp.cumsum(inc)])


def _diagnostics_impl(cost, scn, N_star, x_star, eta, h, t, N, x):
    cost = cost_from_name(cost)
    lam = scn.arrival_rate(0.0)
    tau = jnp.where(scn.allowed, scn.latency, 0.0)
    g = cost.arc(scn)
    f_star = cost.destination(scn, N_star)
    c_star = jnp.where(scn.allowed, f_star[None, :] + g, 0.0)
    idx = jnp.arange(t.shape[0])
    x_del = _delayed(x, h, tau, idx, piecewise_constant=True)  # (S, n, n)
    N_del = _delayed(N, h, tau, idx, piecewise_constant=False)  # (S, n, n): N_j(t - tau_ij)
    allowed, x_star, c_star, g = scn.allowed[None], x_star[None], c_star[None], g[None]
    dx = x - x_star
    R = jnp.sum((lam / (2.0 * eta))[None] * jnp.sum(dx**2, axis=-1), axis=-1)
    Phi = workload_potential(cost, scn, N, N_star[None])
    gap = jnp.sum(workload_gap(cost, scn, N, N_star[None]), axis=-1)
    slack = jnp.sum(lam[None] * jnp.sum(dx * c_star, axis=-1), axis=-1)
    dx_del = jnp.where(allowed, x_del - x_star, 0.0)
    slack_del = jnp.sum(lam[None] * jnp.sum(dx_del * c_star, axis=-1), axis=-1)
    c_now = cost.destination(scn, N)[:, None, :] + g
    c_seen = cost.destination(scn, N_del) + g
    gamma = jnp.where(allowed, dx_del * c_now - dx * c_seen, 0.0)
    mismatch = jnp.sum(lam[None, :, None] * gamma, axis=(-2, -1))
    safe_t = jnp.where(t > 0, t, 1.0)
    int_gap = _cumtrapz(gap, t)
    tad = jnp.where(t > 0, int_gap / safe_t, gap)
    tad_s = jnp.where(t > 0, (int_gap + _cumtrapz(slack, t)) / safe_t, gap + slack)
    V = R + Phi
    rhs = -gap - slack_del + mismatch
    # The routing of tick k is in force on [t_k, t_{k+1}): integrate x-dependent terms with
    # the left-point rule on ticks, the rest with the trapezoid rule.
    left = jnp.concatenate([jnp.zeros(1, t.dtype), jnp.cumsum(rhs[:-1] * jnp.diff(t))])
    excess = (V - V[0]) - left
    return Diagnostics(t, R, Phi, gap, slack, slack_del, mismatch, tad, tad_s, excess)


_diagnostics = eqx.filter_jit(_diagnostics_impl)


@eqx.filter_jit
def batch_diagnostics(cost, scn, N_star, x_star, eta, h, t, N, x) -> Diagnostics:
    """`Diagnostics` for a batch (leading axis on every argument but `cost`), one compile."""
    return jax.vmap(lambda *a: _diagnostics_impl(cost, *a))(scn, N_star, x_star, eta, h, t, N, x)


def lyapunov_diagnostics(
    solution, scenario: Scenario, equilibrium, *, cost: str, step_size
) -> Diagnostics:
    """Theorem-1 diagnostics along a flow-routing trajectory saved at every tick.

    **Arguments:**
    - `solution`: an unbatched `Solution` from `simulate(..., n_save=K)` with one save per
      tick (the delayed terms need the tick-resolution history).
    - `scenario`: the simulated `Scenario` (constant arrival rates).
    - `equilibrium`: an object with `N` and `x` (e.g. `solve_equilibrium(scenario, cost)`).
    - `cost`: the cost family of the policy (`"rif"`, `"latency"`, `"gradient"`).
    - `step_size`: $\\eta$ (scalar or per router).

    **Returns:** `Diagnostics` (theory/lyapunov.md).
    """
    cost_ = cost_from_name(cost)
    t, h = _check_per_tick(solution)
    n = scenario.n_cells
    eta = jnp.broadcast_to(jnp.asarray(step_size, t.dtype), (n,))
    scn = scenario.strip()
    return _diagnostics(
        cost_,
        scn,
        jnp.asarray(equilibrium.N)[..., :n],
        jnp.asarray(equilibrium.x)[..., :n, :n],
        eta,
        jnp.asarray(h, t.dtype),
        t,
        jnp.asarray(solution.N),
        jnp.asarray(solution.x),
    )


def _check_per_tick(solution):
    """`(t, h)` of an unbatched `Solution` saved at every tick, else `ValueError`."""
    t = jnp.asarray(solution.t)
    h = float(solution.tick)
    if solution.t.ndim != 1:
        raise ValueError("lyapunov_diagnostics needs an unbatched Solution; index it first")
    steps = np.diff(np.asarray(t))
    if not np.allclose(steps, h, rtol=1e-9, atol=1e-12):
        raise ValueError(
            f"solution saved every {steps.min():.4g}-{steps.max():.4g} s but tick = {h}: "
            "simulate with n_save equal to the number of ticks (horizon / tick)"
        )
    return t, h


def fit_theorem1(T, eta, distance, *, nonneg: bool = False):
    """Relative least-squares fit of the time-average distance to
    $A/(T\\eta) + B\\eta + C/T$.

    **Arguments:** arrays of horizons `T`, step sizes `eta` and measured time-average
    distances (same shape); `nonneg`: constrain $A, B, C \\ge 0$, as the bound's constants
    are (non-negative least squares, `scipy.optimize.nnls`). The default, unconstrained,
    can return a negative $B$ where the delay term is not visible in the data.

    **Returns:** `dict(A, B, C, r2, rel_rmse)`; `B` is the empirical delay penalty
    $G_1(\\tau)$ of the bound (theory/lyapunov.md, *Shape of Theorem 1*).
    """
    T, eta, y = (np.asarray(v, float).ravel() for v in (T, eta, distance))
    X = np.stack([1.0 / (T * eta), eta, 1.0 / T], axis=1)
    # Relative least squares: the distances span decades.
    w = 1.0 / np.maximum(np.abs(y), 1e-300)
    if nonneg:
        import scipy.optimize

        # Columns scaled to unit norm, so the active-set tolerance is scale free.
        Xw = X * w[:, None]
        norm = np.linalg.norm(Xw, axis=0)
        norm = np.where(norm > 0, norm, 1.0)
        coef, _ = scipy.optimize.nnls(Xw / norm, y * w)
        coef = coef / norm
    else:
        coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    pred = X @ coef
    ss_res = np.sum((y - pred) ** 2)
    ss_tot = np.sum((y - y.mean()) ** 2)
    return {
        "A": float(coef[0]),
        "B": float(coef[1]),
        "C": float(coef[2]),
        "r2": float(1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0,
        "rel_rmse": float(np.sqrt(np.mean(((y - pred) / y) ** 2))),
    }


def loglog_slope(x, y) -> float:
    """Slope of $\\log y$ against $\\log x$ by least squares."""
    return float(np.polyfit(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1)[0])
