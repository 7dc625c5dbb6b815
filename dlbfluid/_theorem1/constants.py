"""Theorem 1's constants as formulas in scenario data (seed App. C.3; theory/lyapunov.md,
*The explicit bound*).

For flow routing around an equilibrium $(N^*, x^*)$ of a cost family $c_{ij} = f_j + g_{ij}$,
with constant arrival rates $\\lambda_i$, delays $\\tau_{ij}$ ($\\bar\\tau = \\max\\tau_{ij}$),
capacities $\\bar\\mu_j$, in-flow bounds $\\Lambda_j = \\sum_{i\\in C^-(j)}\\lambda_i$, margins
$\\Delta\\mu_j = \\bar\\mu_j - \\mu_j(N_j^*)$ and the Lipschitz constant
$v = \\max_j\\max(\\Lambda_j, \\bar\\mu_j)$ of every workload:

* the thresholds $\\bar N_j$, the smallest workloads above which (P1)
  $f_j(N) \\le \\frac2{\\Delta\\mu_j}D_j(N)$ and (P2)
  $f_j(N + 2v\\bar\\tau) \\le (1 + \\frac{\\Delta\\mu_j}{16\\Lambda_j})f_j(N)$ hold for every
  larger $N$ (`thresholds`, a batched 1-D search);
* the cap $B_j = f_j(\\bar N_j + 2v\\bar\\tau)$ of the bounded part, the envelope
  $\\bar F_i = \\max_{j\\in C^+(i)}(g_{ij} + f_j(\\bar N_j))$, the arc weights
  $W_{ij} = \\tau_{ij}(B_j + g_{ij})$;
* the step-size threshold
  $\\eta_0 = \\min_k\\Delta\\mu_k/(32\\sum_{i\\in C^-(k)}\\lambda_i\\sum_{j\\in C^+(i)}W_{ij})$, the
  delay constant $G_1 = 8\\sum_{ij}\\lambda_iW_{ij}\\bar F_i$ and
  $K_4 = \\sum_j\\sup_{N\\ge0}[\\bar\\tau\\Lambda_je_j(N + 2v\\bar\\tau) - \\Phi_j(N)]^+$
  (`Theorem1Constants`, `theorem1_constants`);
* for a start $(N(0), x(0))$ and steps $\\eta_i$: $A = \\sum_i\\lambda_i\\|x_i(0) - x_i^*\\|^2$
  and $C = 2[\\Phi(N(0)) + K_1 + K_b + K_H + K_4 + \\frac14\\bar\\tau\\sum_jD_j(N(0))]$ with
  $K_1 = \\sum\\lambda_i\\tau_{ij}c^*_{ij}$, $K_b = 2\\sum\\lambda_iW_{ij}$ and
  $K_H = \\frac38\\bar\\tau\\sum_jD_j(N(0)) + 2\\bar\\tau\\sum_j\\Lambda_je_j(N_j(0) + v\\bar\\tau)$
  (`StartTerms`, `start_terms`), so that for $\\bar\\eta \\le \\eta_0$

$$\\frac1T\\int_0^T\\Big[\\sum_jD_j + 2\\sum_i\\lambda_iS_i\\Big] \\le \\frac{A}{T\\underline\\eta}
+ G_1\\bar\\eta + \\frac CT.$$

Every search runs inside jit on fixed grids, vmapped over a batch: no Python loop over
scenarios or cells.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._costs import cost_from_name
from .._shapes import like
from .lyapunov import workload_gap, workload_potential_per_cell

# The threshold search scans N* + s u over these offsets u (s = 1 + N*_j), then bisects the
# last sign change (ratio 1.023 between grid points; 15 decades above N*).
_GRID = np.concatenate([[0.0], np.logspace(-6.0, 9.0, 1536)])
_BISECTIONS = 60
# Relative accuracy the bisection reaches (asserted in tests/test_theorem1.py).
THRESHOLD_RTOL = 1e-9


class Theorem1Constants(eqx.Module):
    """The scenario-level constants of Theorem 1 (arrays; a batch adds a leading axis).

    **Fields:**
    - `N_bar`: $\\bar N_j$ (`inf` where the search found none below $N^* + 10^9(1 + N^*)$;
      0 on padded cells).
    - `B`: $B_j = f_j(\\bar N_j + 2v\\bar\\tau)$; `F_bar`: $\\bar F_i$ (0 for routers with no
      arc).
    - `Lam`: $\\Lambda_j$; `dmu`: $\\Delta\\mu_j$; `v`: $v$; `tau_bar`: $\\bar\\tau$.
    - `W`: $W_{ij} = \\tau_{ij}(B_j + g_{ij})$ on the arcs of sources with
      $\\lambda_i > 0$, 0 elsewhere.
    - `kappa_per_eta`: $\\kappa_k(\\eta)/\\bar\\eta = \\frac{8}{\\Delta\\mu_k}\\sum_{i\\in C^-(k)}
      \\lambda_i\\sum_{j\\in C^+(i)}W_{ij}$.
    - `eta0`: $\\eta_0 = 1/(4\\max_k$ `kappa_per_eta`$_k)$ (`inf` without delays).
    - `G1`: $G_1 = 8\\sum_{ij}\\lambda_iW_{ij}\\bar F_i$.
    - `K1`: $K_1 = \\sum_{ij}\\lambda_i\\tau_{ij}c^*_{ij}$; `Kb`: $K_b = 2\\sum_{ij}\\lambda_iW_{ij}$;
      `K4`: $K_4$.
    - `ok`: every threshold and $K_4$'s supremum were found (else the bound is not
      defined and every constant above is reported but not used as a verdict).
    """

    N_bar: Float[Array, "*B n"]
    B: Float[Array, "*B n"]
    F_bar: Float[Array, "*B n"]
    Lam: Float[Array, "*B n"]
    dmu: Float[Array, "*B n"]
    v: Float[Array, "*B"]
    tau_bar: Float[Array, "*B"]
    W: Float[Array, "*B n n"]
    kappa_per_eta: Float[Array, "*B n"]
    eta0: Float[Array, "*B"]
    G1: Float[Array, "*B"]
    K1: Float[Array, "*B"]
    Kb: Float[Array, "*B"]
    K4: Float[Array, "*B"]
    ok: Bool[Array, "*B"]

    def tail_of(self, f):
        """$e_j = (f_j - B_j)^+$ from cost values `f` (cell axis last; unbatched
        constants). The Theorem-1 check and the start terms both read the tail here."""
        B = like(self.B, f)
        return jnp.where(jnp.isfinite(B), jnp.maximum(f - B, 0.0), 0.0)

    def bounded_of(self, f):
        """$b_j = \\min(f_j, B_j)$ from cost values `f` (cell axis last; unbatched
        constants), so that $f_j = b_j + e_j$."""
        return jnp.minimum(f, like(self.B, f))


class _Data(eqx.Module):
    """The scenario data every formula reads (one scenario)."""

    lam: Array
    arc: Array
    tau: Array
    g: Array
    Lam: Array
    dmu: Array
    v: Array
    tau_bar: Array
    real: Array


def _data(cost, scn, N_star) -> _Data:
    lam = jnp.where(scn.cell_mask, scn.arrival_rate(0.0), 0.0)
    arc = scn.allowed & (lam > 0)[:, None] & scn.cell_mask[None, :]
    tau = jnp.where(arc, scn.latency, 0.0)
    g = jnp.where(arc, cost.arc(scn), 0.0)
    Lam = jnp.sum(jnp.where(arc, lam[:, None], 0.0), axis=0)
    mubar = scn.service.capacity
    dmu = jnp.where(scn.cell_mask, mubar - scn.service.rate(N_star), 1.0)
    v = jnp.max(jnp.where(scn.cell_mask, jnp.maximum(Lam, mubar), 0.0))
    return _Data(lam, arc, tau, g, Lam, dmu, v, jnp.max(tau), scn.cell_mask)


def _violates(cost, scn, d: _Data, N_star, N):
    """Where (P1) or (P2) fails at workloads `N` (`(..., n)`)."""
    f = cost.destination(scn, N)
    D = workload_gap(cost, scn, N, jnp.broadcast_to(like(N_star, N), N.shape))
    dmu, Lam = like(d.dmu, N), like(d.Lam, N)
    p1 = f <= 2.0 / dmu * D
    f_up = cost.destination(scn, N + 2.0 * d.v * d.tau_bar)
    grow = jnp.where(Lam > 0, dmu / (16.0 * jnp.where(Lam > 0, Lam, 1.0)), jnp.inf)
    p2 = (f_up <= (1.0 + grow) * f) | (Lam <= 0) | (d.tau_bar <= 0)
    return ~(p1 & p2)


def thresholds(cost, scn, N_star):
    """$\\bar N_j$ of one scenario and whether each was found (module docstring).

    The predicate "(P1) and (P2) hold at $N$" is scanned on the grid
    $N^*_j + (1 + N^*_j)u$, $u \\in \\{0\\} \\cup [10^{-6}, 10^9]$ (log-spaced, ratio 1.023), and
    $\\bar N_j$ is found by bisection between the last grid point where it fails and the
    next, to relative `THRESHOLD_RTOL`. A cell that fails at the last grid point has no
    threshold in range (`found` False, $\\bar N_j = \\infty$). Between grid points the
    predicate is assumed not to fail and recover again (the costs are smooth and their
    growth regular: theory/lyapunov.md discusses the assumption).
    """
    cost = cost_from_name(cost)
    d = _data(cost, scn, N_star)
    s = 1.0 + N_star
    grid = N_star[None, :] + s[None, :] * jnp.asarray(_GRID, N_star.dtype)[:, None]
    bad = _violates(cost, scn, d, N_star, grid)  # (M, n)
    M = grid.shape[0]
    idx = jnp.arange(M)[:, None]
    last = jnp.max(jnp.where(bad, idx, -1), axis=0)  # (n,)
    found = last < M - 1
    lo = jnp.take_along_axis(grid, jnp.clip(last, 0, M - 1)[None, :], axis=0)[0]
    hi = jnp.take_along_axis(grid, jnp.clip(last + 1, 0, M - 1)[None, :], axis=0)[0]

    def bisect(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        b = _violates(cost, scn, d, N_star, mid)
        return jnp.where(b, mid, lo), jnp.where(b, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECTIONS, bisect, (lo, hi))
    N_bar = jnp.where(last < 0, grid[0], hi)
    N_bar = jnp.where(found, N_bar, jnp.inf)
    return jnp.where(d.real, N_bar, 0.0), found | ~d.real


def _K4(cost, scn, d: _Data, N_star, N_bar, B):
    """$K_4$ and whether its supremum lies inside the grid (per cell, then summed).

    $e_j(N + 2v\\bar\\tau) > 0$ only for $N > \\bar N_j$, so the supremum is taken over
    $N = \\bar N_j + (1 + \\bar N_j)u$ on the threshold grid; found when the last grid point
    is not the largest."""
    s = 1.0 + N_bar
    N = N_bar[None, :] + s[None, :] * jnp.asarray(_GRID, N_bar.dtype)[:, None]
    f_up = cost.destination(scn, N + 2.0 * d.v * d.tau_bar)
    e_up = jnp.maximum(f_up - B[None, :], 0.0)
    Phi = workload_potential_per_cell(cost, scn, N, jnp.broadcast_to(N_star[None, :], N.shape))
    val = d.tau_bar * d.Lam[None, :] * e_up - Phi
    best = jnp.argmax(val, axis=0)
    inside = (best < N.shape[0] - 1) | (jnp.max(val, axis=0) <= 0)
    per_cell = jnp.where(d.real, jnp.maximum(jnp.max(val, axis=0), 0.0), 0.0)
    return jnp.sum(per_cell), jnp.all(inside | ~d.real | (d.Lam <= 0))


def _constants_impl(cost, scn, N_star, x_star, N_bar=None) -> Theorem1Constants:
    cost = cost_from_name(cost)
    d = _data(cost, scn, N_star)
    if N_bar is None:
        N_bar, found = thresholds(cost, scn, N_star)
    else:
        found = jnp.isfinite(N_bar)
    finite = jnp.isfinite(N_bar)
    N_safe = jnp.where(finite, N_bar, 0.0)
    B = jnp.where(finite, cost.destination(scn, N_safe + 2.0 * d.v * d.tau_bar), jnp.inf)
    B = jnp.where(d.real, B, 0.0)
    f_bar = jnp.where(finite, cost.destination(scn, N_safe), jnp.inf)
    F_bar = jnp.max(jnp.where(d.arc, d.g + f_bar[None, :], -jnp.inf), axis=1)
    F_bar = jnp.where(jnp.any(d.arc, axis=1), F_bar, 0.0)
    W = jnp.where(d.arc, d.tau * (B[None, :] + d.g), 0.0)
    per_router = jnp.sum(W, axis=1)  # sum_{j in C+(i)} W_ij
    into = jnp.sum(jnp.where(d.arc, (d.lam * per_router)[:, None], 0.0), axis=0)
    kappa = jnp.where(d.real, 8.0 * into / d.dmu, 0.0)
    kmax = jnp.max(kappa)
    eta0 = jnp.where(kmax > 0, 0.25 / jnp.where(kmax > 0, kmax, 1.0), jnp.inf)
    G1 = 8.0 * jnp.sum(d.lam[:, None] * W * jnp.where(d.arc, F_bar[:, None], 0.0))
    f_star = cost.destination(scn, N_star)
    c_star = jnp.where(d.arc, f_star[None, :] + d.g, 0.0)
    K1 = jnp.sum(d.lam[:, None] * d.tau * c_star)
    Kb = 2.0 * jnp.sum(d.lam[:, None] * W)
    K4, k4_ok = _K4(cost, scn, d, N_star, N_safe, jnp.where(finite, B, 0.0))
    ok = jnp.all(found) & k4_ok & jnp.all(jnp.where(d.real, d.dmu > 0, True))
    return Theorem1Constants(
        N_bar=N_bar,
        B=B,
        F_bar=F_bar,
        Lam=d.Lam,
        dmu=d.dmu,
        v=d.v,
        tau_bar=d.tau_bar,
        W=W,
        kappa_per_eta=kappa,
        eta0=eta0,
        G1=G1,
        K1=K1,
        Kb=Kb,
        K4=K4,
        ok=ok,
    )


@eqx.filter_jit
def batch_theorem1_constants(cost, scn, N_star, x_star, N_bar=None) -> Theorem1Constants:
    """`Theorem1Constants` of a batch (stripped scenarios, $N^*$, $x^*$ with a leading
    axis), one compile per shape. `N_bar`: thresholds to use instead of the searched ones
    (`(B, n)`; to see which estimate a wrong threshold breaks)."""
    if N_bar is None:
        return jax.vmap(lambda s, N, x: _constants_impl(cost, s, N, x))(scn, N_star, x_star)
    return jax.vmap(lambda *a: _constants_impl(cost, *a))(scn, N_star, x_star, N_bar)


def theorem1_constants(scenario, equilibrium, *, cost, N_bar=None) -> Theorem1Constants:
    """The constants of Theorem 1 for one scenario and the equilibrium of `cost`
    (module docstring; theory/lyapunov.md, *The explicit bound*).

    **Arguments:** a `Scenario` (constant arrival rates), an equilibrium (`N`, `x`) of the
    cost family `cost` (`solve_equilibrium(scenario, cost)`), and the cost (a name or an
    `AbstractCost`); `N_bar`, thresholds to use instead of the searched ones.

    **Returns:** `Theorem1Constants` of 0-d and `(n,)` arrays.
    """
    n = scenario.n_cells
    one = batch_theorem1_constants(
        cost_from_name(cost),
        jax.tree_util.tree_map(lambda a: a[None], scenario.strip()),
        jnp.asarray(equilibrium.N)[None, ..., :n],
        jnp.asarray(equilibrium.x)[None, ..., :n, :n],
        None if N_bar is None else jnp.asarray(N_bar, float)[None],
    )
    return jax.tree_util.tree_map(lambda a: a[0], one)


class StartTerms(eqx.Module):
    """The start-dependent parts of the bound (arrays over a batch, or 0-d).

    **Fields:** `A` $= \\sum_i\\lambda_i\\|x_i(0) - x_i^*\\|^2$; `Phi0` $= \\Phi(N(0))$;
    `history` $= \\bar\\tau\\sum_jD_j(N(0))$ (the history's $\\int_{-\\bar\\tau}^0\\sum_jD_j$, the
    history being constant); `KH` $= \\frac38$`history`$ + 2\\bar\\tau\\sum_j\\Lambda_j
    e_j(N_j(0) + v\\bar\\tau)$; `C` $= 2[\\Phi_0 + K_1 + K_b + K_H + K_4 +
    \\frac14$`history`$]$; `eta_min`, `eta_bar`: the smallest and largest step of the
    routers with $\\lambda_i > 0$; `in_hypothesis`: $\\bar\\eta \\le \\eta_0$ and the constants
    were found.
    """

    A: Float[Array, "*B"]
    Phi0: Float[Array, "*B"]
    history: Float[Array, "*B"]
    KH: Float[Array, "*B"]
    C: Float[Array, "*B"]
    eta_min: Float[Array, "*B"]
    eta_bar: Float[Array, "*B"]
    in_hypothesis: Bool[Array, "*B"]

    def bound(self, consts: Theorem1Constants, T):
        """$A/(T\\underline\\eta) + G_1\\bar\\eta + C/T$ at horizons `T` (broadcast against a
        trailing axis of horizons when the terms are batched: pass `T` as `(B, H)`)."""
        lead = (...,) + (None,) * (jnp.ndim(T) - jnp.ndim(self.A))
        return (
            self.A[lead] / (T * self.eta_min[lead])
            + consts.G1[lead] * self.eta_bar[lead]
            + self.C[lead] / T
        )


def _start_impl(cost, consts: Theorem1Constants, scn, N_star, x_star, N0, x0, eta):
    cost = cost_from_name(cost)
    d = _data(cost, scn, N_star)
    src = jnp.any(d.arc, axis=1)
    dx = jnp.where(d.arc, x0 - x_star, 0.0)
    A = jnp.sum(d.lam * jnp.sum(dx**2, axis=1))
    Phi0 = jnp.sum(workload_potential_per_cell(cost, scn, N0, N_star))
    hist = d.tau_bar * jnp.sum(workload_gap(cost, scn, N0, N_star))
    tail = consts.tail_of(cost.destination(scn, N0 + d.v * d.tau_bar))
    KH = 0.375 * hist + 2.0 * d.tau_bar * jnp.sum(jnp.where(d.real, d.Lam * tail, 0.0))
    C = 2.0 * (Phi0 + consts.K1 + consts.Kb + KH + consts.K4 + 0.25 * hist)
    eta_min = jnp.min(jnp.where(src, eta, jnp.inf))
    eta_bar = jnp.max(jnp.where(src, eta, 0.0))
    in_hyp = consts.ok & (eta_bar <= consts.eta0) & (eta_min > 0)
    return StartTerms(A, Phi0, hist, KH, C, eta_min, eta_bar, in_hyp)


@eqx.filter_jit
def batch_start_terms(cost, consts, scn, N_star, x_star, N0, x0, eta) -> StartTerms:
    """`StartTerms` of a batch: constants from `batch_theorem1_constants`, the stripped
    scenarios, $N^*$, $x^*$, the starts $N(0)$, $x(0)$ and the per-router steps
    $\\eta_i$, each with a leading batch axis."""
    return jax.vmap(lambda *a: _start_impl(cost, *a))(consts, scn, N_star, x_star, N0, x0, eta)
