"""MNLB: the minimum-network-latency balancer's routing-weight optimiser (seed §1.1, App. B).

Every update period MNLB measures the arrival rates $\\lambda_i$ and solves, in the arc
flows $y_{ij} = \\lambda_i x_{ij}$, the transportation linear program

$$\\min_y \\sum_{(i,j)\\in\\mathcal A} \\tau_{ij} y_{ij} \\quad\\text{s.t.}\\quad
\\sum_j y_{ij} = \\lambda_i,\\quad \\sum_i y_{ij} \\le c\\,\\bar\\mu_j,\\quad y \\ge 0,$$

with $c$ the utilisation cap. When demand does not fit under the cap the program is made
*elastic* (theory/mnlb.md §2): cell $j$ may take an overflow $o_j \\le s\\,\\bar\\mu_j$ above
$c\\bar\\mu_j$, and the solution is lexicographic: first the smallest common relative
overflow $s$ (every cell of the bottleneck ends at utilisation $c + s^\\star$), then the
smallest total overflow $\\sum_j o_j$, then the smallest network latency. The three levels
are one linear program with exact penalties $M_1 s + M_2\\sum_j o_j$ whose weights are
derived from the data (`_penalties`, theory/mnlb.md §2.1).

`_solve_one` solves it with Mehrotra's predictor-corrector interior-point method; the
normal equations are reduced by their block structure to one dense $n\\times n$
Cholesky factorisation per iteration (`_normal_factor`, `_cholesky`, theory/mnlb.md §3).
Every problem of a batch runs the same array program (`jax.vmap`); padded cells carry no
arcs and no arrivals.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._results import RESULTS, view
from .._runtime import exported

MNLB_STATUS = view("success", "not_converged", "nonfinite")
"""The `RESULTS` codes of `mnlb_weights`."""

_TOL = 1e-10  # relative primal/dual residual, duality gap and per-source complementarity
_STALL = 8  # iterations without a better iterate after which the method stops
_MAX_ITERS = 60
_RATE_FLOOR = 1e-4  # sources below this share of demand get a looser row accuracy
_PIVOT = 1e-30  # Cholesky pivots below this fraction of their diagonal are dropped
_HUGE = 1e128
_STEP = 0.9995  # fraction of the step to the boundary
_OVERLOAD = 1e-9  # relative total overflow above which a problem counts as overloaded


class MNLBInfo(eqx.Module):
    """Diagnostics of `mnlb_weights`, one entry per problem (leading axes `...`).

    **Fields:**
    - `load`: `(..., n)` cell loads $z_j = \\sum_i \\lambda_i x_{ij}$ (requests/s).
    - `cell_overflow`: `(..., n)` $\\max(0, z_j - c\\bar\\mu_j)$ (requests/s).
    - `overflow`: total overflow $\\sum_j \\max(0, z_j - c\\bar\\mu_j)$ (requests/s); zero
      when the demand fits under the cap.
    - `theta`: the utilisation bound in force, $c + s^\\star$ ($= c$ when the demand fits);
      every cell's utilisation $z_j/\\bar\\mu_j$ is at most `theta`.
    - `overloaded`: True where `overflow` exceeds $10^{-9}\\sum_i\\lambda_i$.
    - `latency`: the network-latency objective $\\sum_{ij}\\tau_{ij}\\lambda_i x_{ij}$
      (requests in flight on the network, one way).
    - `status`: `RESULTS` code; `gap`: relative duality gap of the penalised program;
      `residual`: largest relative primal/dual residual; `iterations`: interior-point
      iterations used.
    """

    load: Float[Array, "... n"]
    cell_overflow: Float[Array, "... n"]
    overflow: Float[Array, "..."]
    theta: Float[Array, "..."]
    overloaded: Bool[Array, "..."]
    latency: Float[Array, "..."]
    status: Int[Array, "..."]
    gap: Float[Array, "..."]
    residual: Float[Array, "..."]
    iterations: Int[Array, "..."]


# ----------------------------------------------------------------------------------------
# The penalised program
# ----------------------------------------------------------------------------------------


def _penalties(tau, arcs, cell_on, cap):
    """Exact-penalty weights $(M_2, M_1)$ in units where $\\sum_i\\lambda_i = 1$.

    With $\\Delta = \\max_{\\mathcal A}\\tau - \\min_{\\mathcal A}\\tau$ over the arcs in use and
    $m$ the number of cells with capacity, $M_2 = m\\Delta + 1$ exceeds the cost
    $(m-1)\\Delta$ of any alternating path that moves a unit of overflow into spare
    capacity, and $M_1 = 2(\\Delta + M_2)/c$ exceeds the largest rate
    $(\\Delta + M_2)/c$ at which raising $s$ can lower latency plus $M_2\\times$overflow
    (theory/mnlb.md §2.1). `tau` is scaled so that $\\max\\tau = 1$.
    """
    hi = jnp.max(jnp.where(arcs, tau, -jnp.inf))
    lo = jnp.min(jnp.where(arcs, tau, jnp.inf))
    span = jnp.where(jnp.any(arcs), hi - lo, 0.0)
    m = jnp.sum(cell_on).astype(tau.dtype)
    M2 = m * span + 1.0
    M1 = 2.0 * (span + M2) / cap
    return M2, M1


def _unpack(v, n):
    """Split a primal vector into $(y, o, r, q, s)$: layout `[y (n*n), o, r, q (n each), s]`."""
    nn = n * n
    return (
        v[:nn].reshape(n, n),
        v[nn : nn + n],
        v[nn + n : nn + 2 * n],
        v[nn + 2 * n : nn + 3 * n],
        v[nn + 3 * n],
    )


def _pack(y, o, r, q, s):
    return jnp.concatenate([y.reshape(-1), o, r, q, jnp.reshape(s, (1,))])


def _A(v, mu):
    """Constraint operator, rows `[supply i, capacity j, overflow bound j]`:
    $\\sum_j y_{ij}$, $\\sum_i y_{ij} - o_j + r_j$, $o_j - \\bar\\mu_j s + q_j$."""
    y, o, r, q, s = _unpack(v, mu.shape[-1])
    return jnp.concatenate([jnp.sum(y, axis=1), jnp.sum(y, axis=0) - o + r, o - mu * s + q])


def _AT(u, mu, arcs):
    """Transpose operator: the dual prices seen by each primal variable."""
    n = mu.shape[-1]
    u1, u2, u3 = u[:n], u[n : 2 * n], u[2 * n :]
    y = jnp.where(arcs, u1[:, None] + u2[None, :], 0.0)
    return _pack(y, u3 - u2, u2, u3, -jnp.sum(mu * u3))


def _cholesky(K):
    """Lower Cholesky factor of a symmetric positive semidefinite `K`, guarded.

    Right-looking elimination over the columns (a `fori_loop`, so the trace does not grow
    with $n$). A pivot that has lost all but $10^{-14}$ of its original diagonal is pure
    rounding (a direction with no interior, e.g. demand exactly at the cap): it is set
    to $10^{128}$, which zeroes that component of the solution instead of letting the
    factor break down (theory/mnlb.md §3.2).
    """
    n = K.shape[-1]
    idx = jnp.arange(n)
    diag0 = jnp.diagonal(K)

    def step(k, carry):
        A, L = carry
        p = A[k, k]
        p = jnp.where(p > _PIVOT * diag0[k], p, _HUGE)
        below = idx > k
        col = jnp.where(below, A[:, k], 0.0) / jnp.sqrt(p)
        col = col + jnp.where(idx == k, jnp.sqrt(p), 0.0)
        trail = below[:, None] & below[None, :]
        lk = jnp.where(below, col, 0.0)
        A = jnp.where(trail, A - lk[:, None] * lk[None, :], A)
        return A, L.at[:, k].set(col)

    _, L = jax.lax.fori_loop(0, n, step, (K, jnp.zeros_like(K)))
    return L


def _normal_factor(D, mu, src, cell):
    """Factor $A\\,\\mathrm{diag}(D)\\,A^T$ by block elimination; returns its solver.

    The supply block is diagonal ($a_i = \\sum_j D^y_{ij}$) and the overflow-bound block is
    diagonal plus the rank one $D^s\\bar\\mu\\bar\\mu^T$ (Sherman-Morrison), which leaves the
    dense symmetric positive definite capacity block
    $K = \\mathrm{diag}(k) - D^{yT}\\mathrm{diag}(1/a)D^y|_{\\text{off-diag}} + \\gamma gg^T$
    for one Cholesky factorisation (theory/mnlb.md §3.2). Diagonal terms are formed as sums
    of non-negative parts, so without cancellation. Rows of inactive sources or cells are
    the identity.
    """
    n = mu.shape[-1]
    Dy, Do, Dr, Dq, Ds = _unpack(D, n)
    a = jnp.sum(Dy, axis=1)
    a = jnp.where(src & (a > 0), a, 1.0)
    w = jnp.where(cell, 1.0 / jnp.where(cell, Do + Dq, 1.0), 0.0)
    mw = mu * w
    gamma = Ds / (1.0 + Ds * jnp.sum(mu * mw))
    Dya = Dy / a[:, None]
    G = Dya.T @ Dy
    rest = a[:, None] - Dy  # the other arcs of each source (a sum of positive terms)
    kd = jnp.sum(Dya * rest, axis=0) + Dr + Do * Dq * w
    g = Do * mw
    eye = jnp.eye(n, dtype=bool)
    K = jnp.where(eye, kd[:, None], -G) + gamma * g[:, None] * g[None, :]
    both = cell[:, None] & cell[None, :]
    K = jnp.where(both, K, jnp.where(eye, 1.0, 0.0))
    L = _cholesky(K)

    def s33inv(v):
        return w * v - gamma * mw * jnp.sum(mw * v)

    def solve(h):
        h1, h2, h3 = h[:n], h[n : 2 * n], h[2 * n :]
        rhs = jnp.where(cell, h2 - Dya.T @ h1 + Do * s33inv(h3), 0.0)
        t = jax.scipy.linalg.solve_triangular(L, rhs, lower=True)
        du2 = jnp.where(cell, jax.scipy.linalg.solve_triangular(L.T, t, lower=False), 0.0)
        du1 = jnp.where(src, (h1 - Dy @ du2) / a, 0.0)
        du3 = jnp.where(cell, s33inv(h3 + Do * du2), 0.0)
        return jnp.concatenate([du1, du2, du3])

    return solve


def _max_step(v, dv, m):
    """Largest $\\alpha$ with $v + \\alpha\\,dv \\ge 0$ on `m` (inf if unbounded)."""
    return jnp.min(jnp.where(m & (dv < 0), -v / jnp.where(dv < 0, dv, -1.0), jnp.inf))


# One problem in standard form, min c.x, Ax = b, x >= 0 in x = (y, o, r, q, s) (`_pack`),
# scaled to unit total demand and unit largest latency: `mask` the active entries of x (the
# others are held at zero), `rows` the active rows of A, `lh`, `mu` the scaled demands and
# capacities, `src`, `cell` the sources with demand and the cells with capacity, `arcs` the
# allowed arcs between them, `nvar` the number of active entries, `bnorm`, `cnorm`
# 1 + max|b| and 1 + max|c|.
_LP = collections.namedtuple("_LP", "n lh mu src cell arcs mask cost b rows nvar bnorm cnorm")


def _program(lam, tau, live, mu_bar, cell_mask, cap, dt) -> _LP:
    """The standard form of one problem (see `_LP`): the arc latencies and the exact
    penalties of the elastic program (`_penalties`) as the cost, the demand, capacity and
    overflow-bound rows, with $r$ and $q$ the slacks of the last two."""
    n = lam.shape[-1]
    total = jnp.sum(lam)
    scale = jnp.where(total > 0, total, 1.0)
    lh, mu = lam / scale, mu_bar / scale
    src = lh > 0
    cell = cell_mask & (mu > 0)
    arcs = live & src[:, None] & cell[None, :]
    tau_a = jnp.where(arcs, tau, 0.0).astype(dt)
    tscale = jnp.max(tau_a)
    tscale = jnp.where(tscale > 0, tscale, 1.0)
    th = tau_a / tscale
    M2, M1 = _penalties(th, arcs, cell, cap)
    mask = _pack(arcs, cell, cell, cell, jnp.asarray(True))
    zero = jnp.zeros_like(mu)
    cost = _pack(th, jnp.where(cell, M2, 0.0), zero, zero, M1)
    b = jnp.concatenate([lh, jnp.where(cell, cap * mu, 0.0), zero])
    rows = jnp.concatenate([src, cell, cell])
    nvar = jnp.sum(mask).astype(dt)
    bnorm = 1.0 + jnp.max(jnp.abs(b))
    cnorm = 1.0 + jnp.max(jnp.abs(cost))
    return _LP(n, lh, mu, src, cell, arcs, mask, cost, b, rows, nvar, bnorm, cnorm)


def _start(lp: _LP, cap, dt):
    """The starting point `(x0, u0, z0)`: demand spread evenly over each source's arcs,
    the overflow bound just above the largest utilisation, $u_0 = 0$; dual slacks the cost
    plus one, raised where needed so that no product $x_0 z_0$ falls below a hundredth of
    the mean (sources or cells with a tiny share start centred)."""
    lh, mu, cell, arcs, mask = lp.lh, lp.mu, lp.cell, lp.arcs, lp.mask
    deg = jnp.maximum(jnp.sum(arcs, axis=1), 1).astype(dt)
    y0 = jnp.where(arcs, (lh / deg)[:, None], 0.0)
    z0 = jnp.sum(y0, axis=0)
    util = jnp.where(cell, z0 / jnp.where(cell, mu, 1.0), 0.0)
    s0 = jnp.maximum(jnp.max(util) - cap, 0.0) + 0.1
    o0 = jnp.where(cell, 0.5 * s0 * mu, 0.0)
    r0 = jnp.where(cell, jnp.maximum(cap * mu - z0 + o0, 0.1 * mu), 0.0)
    x0 = _pack(y0, o0, r0, o0, s0)
    zs0 = jnp.where(mask, lp.cost + 1.0, 0.0)
    pi0 = jnp.sum(x0 * zs0) / jnp.sum(mask)
    zs0 = jnp.where(mask, jnp.maximum(zs0, 0.01 * pi0 / jnp.where(mask, x0, 1.0)), 0.0)
    return x0, jnp.zeros_like(lp.b), zs0


def _residuals(lp: _LP, x, u, z):
    """The primal and dual residuals $b - Ax$ and $c - A^T u - z$ on the active rows."""
    rp = jnp.where(lp.rows, lp.b - _A(x, lp.mu), 0.0)
    rd = jnp.where(lp.mask, lp.cost - _AT(u, lp.mu, lp.arcs) - z, 0.0)
    return rp, rd


def _measures(lp: _LP, x, u, z):
    """`(primal residual, dual residual, gap, error)`, each relative; the error is their
    largest with the complementarity (inf when NaN)."""
    n = lp.n
    rp, rd = _residuals(lp, x, u, z)
    pres = jnp.max(jnp.abs(rp)) / lp.bnorm
    dres = jnp.max(jnp.abs(rd)) / lp.cnorm
    pobj = jnp.dot(lp.cost, x)
    gap = jnp.abs(pobj - jnp.dot(lp.b, u)) / (1.0 + jnp.abs(pobj))
    # Complementarity per source relative to its rate (floored at _RATE_FLOOR of the
    # total): it bounds the error of the routing row x_i.
    xz = x * z
    comp_y = jnp.sum(xz[: n * n].reshape(n, n), axis=1) / jnp.maximum(lp.lh, _RATE_FLOOR)
    comp = jnp.maximum(jnp.max(comp_y), jnp.sum(xz[n * n :]) / (1.0 + jnp.abs(pobj)))
    err = jnp.maximum(jnp.maximum(pres, dres), jnp.maximum(gap, comp))
    return pres, dres, gap, jnp.where(jnp.isnan(err), jnp.inf, err)


def _direction(lp: _LP, x, z, rp, rd, rxz, D, solve):
    """The Newton direction `(dx, du, dz)` for the complementarity target `rxz`, through
    the reduced normal equations `solve` (`_normal_factor`)."""
    mask, rows, mu, arcs = lp.mask, lp.rows, lp.mu, lp.arcs
    zsafe = jnp.where(mask, z, 1.0)
    h = jnp.where(rows, rp + _A(jnp.where(mask, D * rd - rxz / zsafe, 0.0), mu), 0.0)
    du = solve(h)
    dz = jnp.where(mask, rd - _AT(du, mu, arcs), 0.0)
    dx = jnp.where(mask, (rxz - x * dz) / zsafe, 0.0)
    # One step of iterative refinement on the primal equations A dx = rp: the
    # correction (D A^T e_u, e_u, -A^T e_u) leaves the other two Newton equations
    # intact (theory/mnlb.md §3.3).
    eu = solve(jnp.where(rows, rp - _A(dx, mu), 0.0))
    atu = jnp.where(mask, _AT(eu, mu, arcs), 0.0)
    return dx + D * atu, du + eu, dz - atu


def _mehrotra_step(lp: _LP, x, u, z):
    """One predictor-corrector iteration from `(x, u, z)`: the affine-scaling predictor,
    Mehrotra's centring $\\sigma = (\\mu_{aff}/\\mu)^3$, the corrector, and steps of
    `_STEP` of the way to the boundary."""
    mask, nvar = lp.mask, lp.nvar
    rp, rd = _residuals(lp, x, u, z)
    xz = x * z
    mu_c = jnp.sum(xz) / nvar
    D = jnp.where(mask, x / jnp.where(mask, z, 1.0), 0.0)
    solve = _normal_factor(D, lp.mu, lp.src, lp.cell)
    # predictor (affine scaling)
    dxa, _, dza = _direction(lp, x, z, rp, rd, -xz, D, solve)
    apa = jnp.minimum(1.0, _max_step(x, dxa, mask))
    ada = jnp.minimum(1.0, _max_step(z, dza, mask))
    mu_aff = jnp.dot(x + apa * dxa, z + ada * dza) / nvar
    sigma = jnp.clip((mu_aff / mu_c) ** 3, 0.0, 1.0)
    # corrector with centring
    rxz = jnp.where(mask, sigma * mu_c - xz - dxa * dza, 0.0)
    dx, du, dz = _direction(lp, x, z, rp, rd, rxz, D, solve)
    ap = jnp.minimum(1.0, _STEP * _max_step(x, dx, mask))
    ad = jnp.minimum(1.0, _STEP * _max_step(z, dz, mask))
    return x + ap * dx, u + ad * du, z + ad * dz


def _iterate(lp: _LP, start, dt, *, max_iters, tol):
    """Mehrotra iterations from `start` until the error is at most `tol`, `max_iters`, a
    non-finite error or `_STALL` iterations without a better iterate; returns
    `(iterations, best (x, u, z), its error)` (the best iterate is kept: late iterates
    can drift once the normal equations are too ill-conditioned to improve it)."""

    def body(state):
        k, x, u, z, _, best, best_err, k_best = state
        x, u, z = _mehrotra_step(lp, x, u, z)
        *_, err = _measures(lp, x, u, z)
        better = err < best_err
        best = jax.tree_util.tree_map(lambda p, q: jnp.where(better, p, q), (x, u, z), best)
        best_err = jnp.where(better, err, best_err)
        return k + 1, x, u, z, err, best, best_err, jnp.where(better, k + 1, k_best)

    def cond(state):
        k, *_, err, _, best_err, k_best = state
        return (k < max_iters) & (best_err > tol) & jnp.isfinite(err) & (k - k_best < _STALL)

    x0, u0, zs0 = start
    big = jnp.asarray(jnp.inf, dt)
    init = (jnp.asarray(0), x0, u0, zs0, jnp.asarray(1.0, dt), (x0, u0, zs0), big, jnp.asarray(0))
    k, *_, best, err, _ = jax.lax.while_loop(cond, body, init)
    return k, best, err


def _routing_weights(lp: _LP, yv, tau, live, dt):
    """Routing weights: the flows normalised per source (exactly on the simplex); sources
    without demand take their nearest allowed cell (lowest index on ties), preferring
    cells with capacity."""
    src, cell, arcs = lp.src, lp.cell, lp.arcs
    y = jnp.where(arcs, jnp.maximum(yv, 0.0), 0.0)
    rowsum = jnp.sum(y, axis=1, keepdims=True)
    xw = jnp.where(src[:, None], y / jnp.where(src[:, None], rowsum, 1.0), 0.0)
    pref = live & cell[None, :]
    pref = jnp.where(jnp.any(pref, axis=1, keepdims=True), pref, live)
    near = jnp.argmin(jnp.where(pref, tau, jnp.inf), axis=1)
    near_row = (jnp.arange(lp.n)[None, :] == near[:, None]) & jnp.any(pref, 1, keepdims=True)
    return jnp.where(src[:, None], xw, near_row.astype(dt))


def _solve_one(lam, tau, allowed, mu_bar, cell_mask, cap, *, max_iters, tol):
    """One MNLB program (unbatched); see `mnlb_weights` for the arguments."""
    dt = jnp.result_type(float)
    n = lam.shape[-1]
    lam = jnp.where(cell_mask, lam, 0.0).astype(dt)
    mu_bar = jnp.where(cell_mask, mu_bar, 0.0).astype(dt)
    cap = jnp.asarray(cap, dt)
    live = allowed & cell_mask[:, None] & cell_mask[None, :]
    total = jnp.sum(lam)
    lp = _program(lam, tau, live, mu_bar, cell_mask, cap, dt)
    k, (x, u, z), err = _iterate(lp, _start(lp, cap, dt), dt, max_iters=max_iters, tol=tol)
    pres, dres, gap, _ = _measures(lp, x, u, z)
    yv, _, _, _, sv = _unpack(x, n)
    xw = _routing_weights(lp, yv, tau, live, dt)

    load = jnp.sum(lam[:, None] * xw, axis=0)
    cell_over = jnp.where(cell_mask, jnp.maximum(load - cap * mu_bar, 0.0), 0.0)
    overflow = jnp.sum(cell_over)
    latency = jnp.sum(jnp.where(lp.arcs, tau, 0.0) * lam[:, None] * xw)
    finite = jnp.isfinite(err) & jnp.all(jnp.isfinite(xw))
    status = jnp.where(
        ~finite, RESULTS.nonfinite, jnp.where(err <= tol, RESULTS.success, RESULTS.not_converged)
    ).astype(jnp.int32)
    overloaded = overflow > _OVERLOAD * total
    info = MNLBInfo(
        load=load,
        cell_overflow=cell_over,
        overflow=overflow,
        theta=jnp.where(overloaded, cap + jnp.maximum(sv, 0.0), cap),
        overloaded=overloaded,
        latency=latency,
        status=status,
        gap=gap,
        residual=jnp.maximum(pres, dres),
        iterations=k.astype(jnp.int32),
    )
    return xw, info


def _solve_batch_impl(lam, tau, allowed, mu_bar, cell_mask, cap, *, max_iters, tol):
    f = functools.partial(_solve_one, max_iters=max_iters, tol=tol)
    x, info = jax.vmap(f)(lam, tau, allowed, mu_bar, cell_mask, cap)
    # (the diagnostics as a dict: an output tree that `jax.export` can serialise)
    return x, {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


_solve_batch = jax.jit(_solve_batch_impl, static_argnames=("max_iters", "tol"))


# ----------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------


def _concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _where(idx, lead) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]" if lead else ""


def mnlb_weights(
    arrival_rates,
    latency,
    allowed,
    capacity,
    *,
    utilisation_cap=0.9,
    cell_mask=None,
    tol: float = _TOL,
    max_iters: int = _MAX_ITERS,
):
    """MNLB routing weights: minimum network latency under a utilisation cap (seed §1.1).

    Solves, for every problem of the batch, the linear program in the arc flows
    $y_{ij} = \\lambda_i x_{ij}$

    $$\\min \\sum_{(i,j)\\in\\mathcal A}\\tau_{ij}y_{ij}\\ \\text{ s.t. }\\ \\sum_j y_{ij} =
    \\lambda_i,\\ \\ \\sum_i y_{ij} \\le c\\,\\bar\\mu_j,\\ \\ y \\ge 0,$$

    and returns $x_{ij} = y_{ij}/\\lambda_i$. When $\\sum_i\\lambda_i$ does not fit under
    $c\\bar\\mu$ (bursts, outages), the elastic program is solved instead: lexicographically
    the smallest common relative overflow $s$ (each cell's utilisation at most $c + s$),
    then the smallest total overflow $\\sum_j\\max(0, z_j - c\\bar\\mu_j)$, then the smallest
    network latency. With all arcs allowed this loads every cell to the same utilisation
    $\\sum_i\\lambda_i/\\sum_j\\bar\\mu_j$. (theory/mnlb.md §1-2.)

    **Arguments** (leading batch axes `...` broadcast together; `jax.vmap` also works):
    - `arrival_rates`: `(..., n)` measured $\\lambda_i \\ge 0$ (requests/s).
    - `latency`: `(..., n, n)` one-way $\\tau_{ij} \\ge 0$ (s); ignored off allowed arcs.
    - `allowed`: `(..., n, n)` boolean arc set $\\mathcal A$.
    - `capacity`: `(..., n)` current capacities $\\bar\\mu_j \\ge 0$ (requests/s).
    - `utilisation_cap`: $c \\in (0, 1]$, a scalar or an array of the batch shape.
    - `cell_mask`: `(..., n)` True for real cells; padded cells carry no arcs and no
      arrivals (their rates, capacities and arcs are ignored). Default: all real.
    - `tol`, `max_iters`: interior-point stopping tolerance and iteration cap.

    **Returns:** `(x, info)`: `x` `(..., n, n)` rows on the simplex over allowed arcs
    (sources with $\\lambda_i = 0$: all weight on the nearest allowed cell with capacity,
    lowest index on ties; padded sources, and real ones without any allowed arc: a zero
    row); `info` an `MNLBInfo`. Where several routings are optimal, `x` is an interior
    point of the optimal set (ties are split, not broken).

    **Raises:** `ValueError` naming the field, the value and what is allowed, for shape
    mismatches, a cap outside $(0, 1]$, negative or non-finite rates, capacities or
    latencies, and a source with demand but no allowed arc to a cell with capacity
    (checked on concrete inputs; under an outer `jit`/`vmap` such problems report a
    non-success `status` instead).
    """
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol = {tol!r} is invalid: expected a finite number > 0")
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
        raise ValueError(f"max_iters = {max_iters!r} is invalid: expected an integer >= 1")
    lam = jnp.asarray(arrival_rates)
    tau = jnp.asarray(latency)
    allowed = jnp.asarray(allowed)
    mu = jnp.asarray(capacity)
    cap = jnp.asarray(utilisation_cap)
    if lam.ndim < 1:
        raise ValueError(
            f"arrival_rates has shape {lam.shape}: expected (..., n), one rate per source"
        )
    n = lam.shape[-1]
    if n < 1:
        raise ValueError("arrival_rates has shape (..., 0): expected at least one cell")
    if cell_mask is None:
        cell_mask = jnp.ones(lam.shape[-1:], dtype=bool)
    cell_mask = jnp.asarray(cell_mask)
    want = {
        "arrival_rates": (lam, (n,)),
        "latency": (tau, (n, n)),
        "allowed": (allowed, (n, n)),
        "capacity": (mu, (n,)),
        "cell_mask": (cell_mask, (n,)),
    }
    lead = []
    for name, (a, core) in want.items():
        k = len(core)
        if a.ndim < k or a.shape[a.ndim - k :] != core:
            raise ValueError(
                f"{name} has shape {a.shape}: expected (..., {', '.join(map(str, core))}) "
                f"with n = {n} cells (from arrival_rates)"
            )
        lead.append(a.shape[: a.ndim - k])
    for name, a in (("allowed", allowed), ("cell_mask", cell_mask)):
        if a.dtype != jnp.bool_:
            raise ValueError(f"{name} has dtype {a.dtype}: expected bool")
    try:
        batch = jnp.broadcast_shapes(*lead, cap.shape)
    except ValueError:
        shapes = dict(zip(want, lead)) | {"utilisation_cap": cap.shape}
        raise ValueError(
            f"batch shapes {shapes} do not broadcast together: expected leading axes that "
            "broadcast (e.g. all equal, or 1)"
        ) from None
    _check_values(lam, tau, allowed, mu, cap, cell_mask, batch, n)

    B = math.prod(batch)
    dt = jnp.result_type(float)

    def flat(a, core, dtype):
        return jnp.broadcast_to(a, batch + core).reshape((B,) + core).astype(dtype)

    args = (
        flat(lam, (n,), dt),
        flat(tau, (n, n), dt),
        flat(allowed, (n, n), bool),
        flat(mu, (n,), dt),
        flat(cell_mask, (n,), bool),
        flat(cap, (), dt),
    )
    static = dict(max_iters=max_iters, tol=float(tol))
    x, info = exported.call(
        "mnlb",
        functools.partial(_solve_batch, **static),
        args,
        static,
        trace=functools.partial(_solve_batch_impl, **static),
    )
    info = MNLBInfo(**info)
    return jax.tree_util.tree_map(lambda a: a.reshape(batch + a.shape[1:]), (x, info))


def _check_values(lam, tau, allowed, mu, cap, cell_mask, batch, n):
    """First-tier checks on concrete inputs (skipped for tracers under an outer jit)."""
    if _concrete(cap):
        c = np.asarray(cap, dtype=float)
        bad = ~((c > 0) & (c <= 1))
        if bad.any():
            v = float(c[bad].flat[0]) if c.ndim else float(c)
            raise ValueError(f"utilisation_cap = {v!r} is invalid: expected a fraction in (0, 1]")
    if not all(_concrete(a) for a in (lam, tau, allowed, mu, cell_mask)):
        return
    full = tuple(batch)
    L = np.broadcast_to(np.asarray(lam, dtype=float), full + (n,))
    T = np.broadcast_to(np.asarray(tau, dtype=float), full + (n, n))
    A = np.broadcast_to(np.asarray(allowed), full + (n, n))
    M = np.broadcast_to(np.asarray(mu, dtype=float), full + (n,))
    C = np.broadcast_to(np.asarray(cell_mask), full + (n,))

    def fail(name, bad, arr, what):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{', '.join(map(str, idx))}] = {float(arr[idx])!r} {what}")

    for name, arr in (("arrival_rates", L), ("capacity", M)):
        bad = C & ~(np.isfinite(arr) & (arr >= 0))
        if bad.any():
            fail(name, bad, arr, "is invalid: expected a finite number >= 0 (requests/s)")
    live = A & C[..., :, None] & C[..., None, :]
    bad = live & ~(np.isfinite(T) & (T >= 0))
    if bad.any():
        fail("latency", bad, T, "is invalid on an allowed arc: expected a finite number >= 0 (s)")
    stuck = C & (L > 0) & ~np.any(live & (M > 0)[..., None, :], axis=-1)
    if stuck.any():
        fail(
            "arrival_rates",
            stuck,
            L,
            "is a demand with no allowed arc to a cell with capacity > 0: every source with "
            "demand needs an allowed arc (allowed[..., i, :]) to a real cell with capacity > 0",
        )
