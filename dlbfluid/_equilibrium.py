"""Equilibria of the DLB fluid model as one batched convex program (seed §4, App. C.2).

For a cost family $c_{ij}(N_j) = f_j(N_j) + g_{ij}$ (`rif`, `latency`, `gradient`), the
equilibrium routing minimises the potential

$$\\Psi(x) = \\sum_j p_j(z_j) + \\sum_{(i,j)} g_{ij}\\lambda_i x_{ij}, \\qquad
z_j = \\sum_i \\lambda_i x_{ij}, \\qquad p_j(z) = \\int_0^z f_j(\\mu_j^{-1}(s))\\,ds$$

over the product of simplices restricted to allowed arcs, with $z_j < \\bar\\mu_j$
(theory/equilibria.md §1). The solver works with the arc flows $y_{ij} = \\lambda_i x_{ij}$
(`_solve_one`, theory/equilibria.md §3):

1. an infeasible-start interior-point method (a barrier on $y \\ge 0$ weighted per
   source, primal-dual Hessians, steps that keep $y > 0$ *and* $z < \\bar\\mu$, and a
   backtracking line search on a primal merit function that needs only its slope)
   brings the per-source duality gap below `1e-10`;
2. an active-set Newton *polish* then solves the equality optimality system on the
   identified support to rounding level.

Both stages solve their Newton systems through a Schur complement in the per-source
multipliers, a symmetric diagonally dominant M-matrix that is factored by GTH-style
(subtraction-free) elimination, so the solve keeps its accuracy when the interior-point
weights span many orders of magnitude. Every scenario of a batch runs the same array
program (vmap); padded cells carry no arcs and no arrivals. `_certify` turns the result
into a routing, workloads and a KKT certificate (theory/equilibria.md §2).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._costs import COSTS, arc_cost, check_cost, destination_cost
from ._devices import per_device, shard_batch, solver_jit
from ._errors import OverloadError
from ._scenario import Scenario, check_capacity, pad_scenario
from ._service import SOFTPLUS, ServiceModel, softplus_sigmoid

EQ_STATUS = {"success": 0, "not_converged": 1, "nonfinite": 2}
EQ_STATUS_NAMES = {v: k for k, v in EQ_STATUS.items()}
EQ_STATUS_MESSAGES = {
    0: "success",
    1: "the KKT residual did not reach `tol` (interior point stopped after `max_iters` "
    "iterations or on a failed line search)",
    2: "a non-finite value appeared",
}

# Python-side count of traces of the batched solver, per cost (tests check recompiles).
_TRACES: collections.Counter = collections.Counter()

_IPM_TOL = 1e-10  # per-source duality gap at which the polish takes over (second try)
_IPM_SWITCH = 1e-6  # ... and on the first try (a failed early polish resumes stage 1)
_RETRY = 1e-2  # first polish failed: best scaled residual above this times `tol`
_IPM_FEAS = 1e-8  # relative demand residual below which a point counts as feasible
_POLISH_ITERS = 8
_POLISH_REG = 1e-9  # proximal weight of the polish step, relative to the cell curvature
_POLISH_DONE = 1e-14  # scaled residual at which the polish stops early
_TINY = 1e-300
_KAPPA = 0.1  # the barrier weight stays above this times the relative demand residual
_RD = 1.0  # hand-over: relative dual residual below this times the barrier gap target
_CAP_FRAC = 0.8  # a step uses at most this fraction of the remaining capacity slack
_HUGE = 1e300


class EquilibriumError(RuntimeError):
    """A scenario of a `throw=True` equilibrium solve did not converge."""


# ----------------------------------------------------------------------------------------
# Flow-space service functions
# ----------------------------------------------------------------------------------------


def inverse_rate(service: ServiceModel, z, guess=None, *, max_iter: int = 60):
    """$N_j = \\mu_j^{-1}(z_j)$ for $0 \\le z_j < \\bar\\mu_j$, $+\\infty$ for $z_j \\ge \\bar\\mu_j$.

    M/M/1: $z/(\\bar\\mu - z)$. Softplus: Newton on
    $h(N) = N(\\bar\\mu - z)/\\bar\\mu - z\\,[a_0 + \\beta s\\,\\mathrm{sp}((N_0-N)/s)]$, which is
    $N - z\\ell(N)$ written without cancellation. $h$ is concave and increasing, so Newton
    steps from any point left of the root increase monotonically to it; the start is the
    lower bound $\\max(zL_0,\\ z a_0/(1-z\\beta))$ (from $\\ell(N) \\ge \\max(L_0, a_0+\\beta N)$)
    or a warm `guess` above it (a step from the right lands left of the root). Iterates
    until every relative step is below $10^{-13}$ (theory/equilibria.md §3.3).
    """
    cap = service.capacity
    inside = z < cap
    zc = jnp.where(inside, jnp.maximum(z, 0.0), 0.0)
    mm1 = zc / (cap - zc)
    sp = service.model == SOFTPLUS
    zs = jnp.where(sp, zc, 0.0)
    slack = (cap - zs) / cap
    beta = 1.0 / cap
    L0, N0, s = service.base_latency, service.knee, service.width
    a0 = L0 - beta * N0
    lb = jnp.maximum(zs * L0, zs * a0 / slack)
    if guess is None:
        N = lb
    else:
        g = jnp.where(jnp.isfinite(guess), guess, 0.0)
        N = jnp.maximum(g, lb)

    def step(N):
        sp_v, _, sg_v, _ = softplus_sigmoid((N0 - N) / s)
        h = N * slack - zs * (a0 + beta * s * sp_v)
        hp = slack + zs * beta * sg_v
        return jnp.maximum(N - h / hp, lb)

    def cond(c):
        k, N, Nn = c
        return (k < max_iter) & jnp.any(jnp.abs(Nn - N) > 1e-13 * Nn)

    def body(c):
        k, _, Nn = c
        return k + 1, Nn, step(Nn)

    _, _, N = jax.lax.while_loop(cond, body, (jnp.asarray(0), N, step(N)))
    out = jnp.where(sp, N, mm1)
    return jnp.where(inside, out, jnp.inf)


# Gauss-Legendre rule for the potentials of softplus cells: 16 nodes on each of 8
# panels graded towards the knee, with edges at N0 + s * _GL_EDGES (then clipped to the
# integration window). The integrand is analytic with poles at distance pi (in units of
# s) from the real axis, and deviates from its asymptotes only within a few s of the
# knee: graded panels reach rounding level (8e-16 relative, against 64 x 32 uniform
# panels) where 8 uniform panels of 16 nodes, the same work, stopped at 2e-10.
_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)
_GL_EDGES = np.array([-40.0, -20.0, -10.0, -5.0, 0.0, 5.0, 10.0, 20.0, 40.0])


def _gl_integral(fun, knee, width, a, b):
    """$\\int_a^b$ `fun` by composite Gauss-Legendre on panels graded towards `knee`
    (elementwise over cells; $[a, b] \\subseteq$ knee $\\pm 40$ width)."""
    edges = jnp.clip(
        knee[..., None] + width[..., None] * jnp.asarray(_GL_EDGES), a[..., None], b[..., None]
    )
    lo, hi = edges[..., :-1], edges[..., 1:]
    mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
    nodes = mid[..., None] + half[..., None] * jnp.asarray(_GL_X)
    vals = fun(nodes)
    return jnp.sum(jnp.sum(vals * jnp.asarray(_GL_W), axis=-1) * half, axis=-1)


def potential(cost: str, scn: Scenario, z, N):
    """$p_j(z_j) = \\int_0^{z_j} f_j(\\mu_j^{-1}(s))ds = \\int_0^{N_j} f_j(n)\\mu_j'(n)\\,dn$.

    Closed forms (theory-notes §4, theory/equilibria.md §1.2): gradient $p = N$; M/M/1
    latency $\\ln(1+N)$; M/M/1 RIF $(-z + \\bar\\mu\\ln(1+N))/k$. Softplus latency and RIF
    split $[0, N]$ at $N_0 \\mp 40s$: below the knee $\\ell \\equiv L_0$ (exact to $e^{-40}$),
    above it $\\ell = a_0 + \\beta n$ (closed forms), and the knee window is integrated by
    composite Gauss-Legendre on panels graded towards the knee (`_gl_integral`; about
    1e-15 relative).
    """
    svc = scn.service
    if cost == "gradient":
        return N
    cap, L0, N0, s = svc.capacity, svc.base_latency, svc.knee, svc.width
    beta = 1.0 / cap
    a0 = L0 - beta * N0
    sp = svc.model == SOFTPLUS
    Nf = jnp.where(jnp.isfinite(N), N, 0.0)
    a = jnp.clip(N0 - 40.0 * s, 0.0, Nf)
    b = jnp.clip(N0 + 40.0 * s, a, Nf)

    def ell_q(n):
        v = jnp.expand_dims
        L0_, N0_, s_, b_ = v(L0, -1), v(N0, -1), v(s, -1), v(beta, -1)
        while L0_.ndim < n.ndim:
            L0_, N0_, s_, b_ = v(L0_, -1), v(N0_, -1), v(s_, -1), v(b_, -1)
        u = (n - N0_) / s_
        sp_u, _, sg_u, _ = softplus_sigmoid(u)
        ell = L0_ + b_ * s_ * sp_u
        q = ell - n * b_ * sg_u
        return ell, q

    if cost == "latency":
        # integrand l mu' = q / l
        def fun(n):
            ell, q = ell_q(n)
            return q / ell

        left = a
        right = (a0 / beta) * jnp.log((a0 + beta * Nf) / (a0 + beta * b))
        p_sp = left + _gl_integral(fun, N0, s, a, b) + right
        p_mm1 = jnp.log1p(Nf)
    elif cost == "rif":
        # integrand (n/k) mu' = n q / (k l^2)
        def fun(n):
            ell, q = ell_q(n)
            return n * q / ell**2

        left = a**2 / (2.0 * L0)
        right = (a0 / beta**2) * (
            jnp.log((a0 + beta * Nf) / (a0 + beta * b))
            + a0 / (a0 + beta * Nf)
            - a0 / (a0 + beta * b)
        )
        p_sp = (left + _gl_integral(fun, N0, s, a, b) + right) / scn.replicas
        p_mm1 = (-z + cap * jnp.log1p(Nf)) / scn.replicas
    else:
        raise ValueError(f"cost = {cost!r} is invalid: allowed costs are {list(COSTS)}")
    out = jnp.where(sp, p_sp, p_mm1)
    return jnp.where(jnp.isfinite(N), out, jnp.inf)


# ----------------------------------------------------------------------------------------
# Newton systems
# ----------------------------------------------------------------------------------------


def _mmatrix_factor(off, excess):
    """Factor $S = LU$ for a symmetric M-matrix given by its off-diagonal part `off`
    ($\\le 0$, zero diagonal) and its row sums `excess` $v_i = \\sum_k S_{ik} \\ge 0$.

    Gaussian elimination in the GTH form: every pivot is recomputed as the remaining
    off-diagonal mass plus the row excess, and the excesses are updated as sums of
    non-negative terms, so no step subtracts nearly equal numbers (theory/equilibria.md
    §3.2). No pivoting is needed: the matrix stays diagonally dominant. Returns the
    eliminated matrix (its strict upper part is $U$'s, its strict lower part holds the
    eliminated column entries, $L_{ik} = $ entry $/$ pivot) and the pivots.
    """
    n = excess.shape[-1]
    idx = jnp.arange(n)
    offdiag = idx[:, None] != idx[None, :]

    def elim(k, carry):
        A, v, piv = carry
        rem = idx > k
        p = v[k] + jnp.sum(jnp.where(rem, -A[k], 0.0))
        p = jnp.where(p > 0, p, 1.0)
        l = jnp.where(rem, A[:, k] / p, 0.0)
        upd = rem[:, None] & rem[None, :] & offdiag
        A = jnp.where(upd, A - l[:, None] * A[k][None, :], A)
        v = jnp.where(rem, v - l * v[k], v)
        return A, v, piv.at[k].set(p)

    A, _, piv = jax.lax.fori_loop(0, n, elim, (off, excess, jnp.ones_like(excess)))
    return A, piv


def _mmatrix_apply(A, piv, b):
    """Solve $Su = b$ with the factors of `_mmatrix_factor`; `b` is `(n,)` or `(n, k)`."""
    n = piv.shape[-1]
    vec = b.ndim == 1
    if vec:
        b = b[:, None]
    idx = jnp.arange(n)

    def fwd(k, r):
        l = jnp.where(idx > k, A[:, k] / piv[k], 0.0)
        return r - l[:, None] * r[k][None, :]

    rhs = jax.lax.fori_loop(0, n, fwd, b)

    def back(t, u):
        k = n - 1 - t
        rem = idx > k
        r = rhs[k] - jnp.sum(jnp.where(rem[:, None], A[k][:, None] * u, 0.0), axis=0)
        return u.at[k].set(r / piv[k])

    u = jax.lax.fori_loop(0, n, back, jnp.zeros_like(b))
    return u[:, 0] if vec else u


def _mmatrix_solve(off, excess, b):
    """Solve $Su = b$ for the M-matrix of `_mmatrix_factor` (`b` `(n,)` or `(n, k)`)."""
    return _mmatrix_apply(*_mmatrix_factor(off, excess), b)


class _Schur(eqx.Module):
    """The reduced Newton system of `_newton_direction`, factored once for several
    right-hand sides."""

    E: Array
    W: Array
    EW: Array
    A: Array
    piv: Array
    src: Array

    def solve(self, q, rp):
        """`(dy, dnu)` for the right-hand side `q` `(n, n)`, `rp` `(n,)`."""
        E, W, EW = self.E, self.W, self.EW
        Eq = E * q
        Q = jnp.sum(Eq, axis=0)
        rhs = jnp.where(self.src, -rp + jnp.sum(Eq, axis=1) - EW @ Q, 0.0)
        dnu = _mmatrix_apply(self.A, self.piv, rhs)
        w = W * (E.T @ dnu - Q)
        dy = E * (dnu[:, None] - w[None, :] - q)
        return dy, dnu


def _schur(E, P, src) -> _Schur:
    """Eliminate $\\Delta y$ and $\\Delta z$ from the Newton system of `_newton_direction`
    and factor the remaining M-matrix in the multipliers."""
    n = E.shape[-1]
    eye = jnp.eye(n, dtype=bool)
    f = jnp.sum(E, axis=0)
    W = 1.0 / (f + 1.0 / P)
    EW = E * W[None, :]
    # S's off-diagonal part as a sum of n outer products (n is static): XLA fuses it into
    # one elementwise pass, about 3x faster on CPU than its batched `dot` of tiny
    # matrices.
    off = -sum(EW[:, j][:, None] * E[:, j][None, :] for j in range(n))
    both = src[:, None] & src[None, :] & ~eye
    off = jnp.where(both, off, 0.0)
    excess = jnp.where(src, jnp.sum(EW / P[None, :], axis=1), 1.0)
    A, piv = _mmatrix_factor(off, excess)
    return _Schur(E=E, W=W, EW=EW, A=A, piv=piv, src=src)


def _newton_direction(E, q, rp, P, src):
    """Solve the linearised KKT system in the arc flows for `(dy, dnu)`:

    $P_j\\,\\Delta z_j - \\Delta\\nu_i + \\Delta y_{ij}/E_{ij} = -q_{ij}$ on arcs with $E_{ij} > 0$,
    $\\sum_j \\Delta y_{ij} = -r^p_i$, $\\Delta z_j = \\sum_i \\Delta y_{ij}$.

    Eliminating $w_j = P_j\\Delta z_j = W_j(\\sum_i E_{ij}\\Delta\\nu_i - \\sum_i E_{ij}q_{ij})$,
    $W_j = 1/(\\sum_i E_{ij} + 1/P_j)$, leaves $S\\Delta\\nu = \\text{rhs}$ with
    $S_{ik} = -\\sum_j E_{ij}W_jE_{kj}$ ($i \\ne k$) and row sums $\\sum_j E_{ij}W_j/P_j$
    (theory/equilibria.md §3.2). Rows of sources without demand are the identity.
    """
    return _schur(E, P, src).solve(q, rp)


def _step_to_boundary(v, dv, mask):
    """Largest $\\alpha$ with $v + \\alpha\\,dv \\ge 0$ on `mask` (inf if unbounded)."""
    r = jnp.where(mask & (dv < 0), -v / jnp.where(dv < 0, dv, -1.0), jnp.inf)
    return jnp.min(r)


def _step_to_boundary_inv(inv_v, dv, mask):
    """`_step_to_boundary` for $v > 0$ on `mask` given $1/v$: one reduction of the rates
    $-dv/v$ and one scalar division instead of a division per entry."""
    rate = jnp.max(jnp.where(mask, -dv * inv_v, 0.0))
    return jnp.where(rate > 0, 1.0 / jnp.where(rate > 0, rate, 1.0), jnp.inf)


# ----------------------------------------------------------------------------------------
# One scenario
# ----------------------------------------------------------------------------------------


class _Problem(eqx.Module):
    scn: Scenario
    lam: Float[Array, " n"]
    g: Float[Array, "n n"]
    A: Bool[Array, "n n"]  # arcs that may carry flow: allowed, real cells, source demand > 0
    arcs: Bool[Array, "n n"]  # allowed arcs between real cells
    src: Bool[Array, " n"]  # real cells with demand
    cost: str = eqx.field(static=True)

    def cells(self, N, z):
        """Cell terms of the joint $(y, N)$ Newton system (theory/equilibria.md §3.2).

        The flow balance is written $h_j(N_j, z_j) = N_j - z_j\\ell_j(N_j) = 0$ in the
        cancellation-free form $N(\\bar\\mu - z)/\\bar\\mu - z\\,r(N)$ with $r = \\ell - \\beta N$
        ($\\beta$ for M/M/1, $a_0 + \\beta s\\,\\mathrm{sp}((N_0-N)/s)$ for softplus), which is
        affine in $N$ for M/M/1 cells and nearly so for softplus cells. Returns $F = f(N)$,
        the residual $h$, $\\partial h/\\partial N$, $\\ell$ ($= -\\partial h/\\partial z$) and
        $f'(N)$.
        """
        svc = self.scn.service
        cap = svc.capacity
        beta = 1.0 / cap
        sp = svc.model == SOFTPLUS
        v = (svc.knee - N) / svc.width
        a0 = svc.base_latency - beta * svc.knee
        sp_v, _, sg_v, _ = softplus_sigmoid(v)
        rest = jnp.where(sp, a0 + beta * svc.width * sp_v, beta)
        drest = jnp.where(sp, -beta * sg_v, 0.0)
        ell = beta * N + rest
        h = N * (cap - z) / cap - z * rest
        hN = (cap - z) / cap - z * drest
        Ne = jnp.maximum(N, 1e-300)
        F, dF = jax.jvp(
            lambda M: destination_cost(self.cost, self.scn, M), (Ne,), (jnp.ones_like(Ne),)
        )
        return F, h, hN, ell, dF


def _make_problem(scn: Scenario, lam, cost: str) -> _Problem:
    mask = scn.cell_mask
    arcs = scn.allowed & mask[:, None] & mask[None, :]
    lam = jnp.where(mask, lam, 0.0)
    src = mask & (lam > 0)
    A = arcs & src[:, None]
    return _Problem(scn=scn, lam=lam, g=arc_cost(cost, scn), A=A, arcs=arcs, src=src, cost=cost)


def _certify(pb: _Problem, y, N_guess):
    """Routing, state and KKT certificate of the flows `y` (theory/equilibria.md §2).

    Rows of sources with demand are $x_i = y_i/\\sum_j y_{ij}$; a source without demand
    routes to its cheapest allowed cell. With $c_i = \\sum_j x_{ij}c_{ij}$ (the multiplier
    estimate) and `used` $= x_{ij} > 0$:

    * `flow_residual` $= \\max(\\max_j|\\mu_j(N_j) - z_j|, \\max_i|\\sum_j y_{ij} - \\lambda_i|)/\\Lambda$
      with $z_j = \\sum_i y_{ij}$ (so a non-converged iterate is reported inside the
      capacity domain, with its demand mismatch here);
    * `slackness_max_used` $= \\max_{\\text{used}}(c_{ij} - c_i)$ (0 at an equilibrium);
    * `slackness_min_allowed` $= \\min_{\\text{allowed}}(c_{ij} - c_i)$ (0 at an equilibrium);
    * `duality_gap` $= \\sum_{ij}\\lambda_i x_{ij}(c_{ij} - \\min_k c_{ik}) \\ge \\Psi(x) - \\Psi^*$;
    * `kkt_residual` $= \\max(\\text{flow}, \\text{max\\_used}/\\bar c, (-\\text{min\\_allowed})^+/\\bar c)$
      with $\\bar c = \\max_i c_i$ over sources with demand.
    """
    scn, lam, A, src = pb.scn, pb.lam, pb.A, pb.src
    yA = jnp.where(A, jnp.maximum(y, 0.0), 0.0)
    row = jnp.sum(yA, axis=1, keepdims=True)
    xd = jnp.where(A & (row > 0), yA / jnp.where(row > 0, row, 1.0), 0.0)
    # z is the flow the iterate carries (always inside the capacity domain); the mismatch
    # between its rows and the demand is part of the flow residual.
    z = jnp.sum(yA, axis=0)
    N = inverse_rate(scn.service, z, N_guess)
    F = destination_cost(pb.cost, scn, N)
    c = jnp.where(pb.arcs, F[None, :] + pb.g, jnp.inf)
    cmin = jnp.min(c, axis=1)
    has_arc = jnp.any(pb.arcs, axis=1)
    first = jnp.argmin(c, axis=1)
    onehot = (jnp.arange(lam.shape[0])[None, :] == first[:, None]) & pb.arcs
    x = jnp.where(src[:, None], xd, jnp.where(has_arc[:, None], onehot.astype(xd.dtype), 0.0))
    cf = jnp.where(pb.arcs, c, 0.0)
    ci = jnp.where(has_arc, jnp.sum(x * cf, axis=1), 0.0)
    used = pb.arcs & (x > 0)
    gap = cf - ci[:, None]
    max_used = jnp.max(jnp.where(used & src[:, None], gap, -jnp.inf))
    min_allowed = jnp.min(jnp.where(pb.arcs & src[:, None], gap, jnp.inf))
    any_src = jnp.any(src)
    max_used = jnp.where(any_src, max_used, 0.0)
    min_allowed = jnp.where(any_src, min_allowed, 0.0)
    Lam = jnp.sum(lam)
    Lam_s = jnp.where(Lam > 0, Lam, 1.0)
    mu = scn.service.rate(jnp.where(jnp.isfinite(N), N, 0.0))
    flow = jnp.max(jnp.where(scn.cell_mask, jnp.abs(mu - z), 0.0))
    simplex = jnp.max(jnp.where(src, jnp.abs(row[:, 0] - lam), 0.0))
    flow_res = jnp.maximum(flow, simplex) / Lam_s
    cbar = jnp.max(jnp.where(src, jnp.abs(ci), 0.0))
    cbar = jnp.where(cbar > 0, cbar, 1.0)
    kkt = jnp.maximum(flow_res, jnp.maximum(max_used, 0.0) / cbar)
    kkt = jnp.maximum(kkt, jnp.maximum(-min_allowed, 0.0) / cbar)
    yx = lam[:, None] * x
    dual_gap = jnp.sum(jnp.where(pb.arcs & src[:, None], yx * (cf - cmin[:, None]), 0.0))
    Nm = jnp.where(scn.cell_mask, N, 0.0)
    p = jnp.where(scn.cell_mask, potential(pb.cost, scn, z, N), 0.0)
    objective = jnp.sum(p) + jnp.sum(jnp.where(pb.arcs, pb.g * yx, 0.0))
    tau = jnp.where(pb.arcs, scn.latency, 0.0)
    social = jnp.sum(Nm) + jnp.sum(2.0 * tau * yx)
    ok = (
        jnp.isfinite(kkt)
        & jnp.all(jnp.isfinite(Nm))
        & jnp.all(jnp.isfinite(x))
        & jnp.isfinite(objective)
    )
    kkt = jnp.where(ok, kkt, jnp.inf)
    return dict(
        x=x,
        z=z,
        N=Nm,
        multipliers=ci,
        objective=objective,
        social_cost=social,
        mean_latency=social / Lam_s,
        kkt_residual=kkt,
        flow_residual=flow_res,
        slackness_max_used=max_used,
        slackness_min_allowed=min_allowed,
        duality_gap=dual_gap,
        finite=ok,
    )


def _stages(scn: Scenario, lam, tol, max_iters, *, cost: str):
    """The two stages of one scenario's solve (theory/equilibria.md §3): its initial state
    `st0`, the loop conditions `cond_ipm`/`cond_polish`, the loop `body(st, stage1)` and
    `finish(st)`, the certificate. `_solve_one` runs them; `_solve_local` runs them over a
    batch, finishing stage 1's stragglers on a compacted sub-batch.

    **Stage 1, interior point** (`phase = 0`): a primal barrier method with primal-dual
    Hessians. For a barrier weight $\\tau$ it minimises
    $\\phi_\\tau(y) = \\Psi(y) - \\tau\\sum_{(i,j)\\in A} w_{ij}\\ln y_{ij}$ subject to
    $\\sum_j y_{ij} = \\lambda_i$, with weights $w_{ij} = \\lambda_i\\bar c_i$ (demand times the
    cost level $\\bar c_i = \\min_j c_{ij}$ of the source, so that every source approaches its
    support at the same relative rate). The workloads are always exact, $N = \\mu^{-1}(z)$,
    so $F_j(z_j)$ is itself a barrier at $z_j \\to \\bar\\mu_j$. Each iteration solves the
    Newton system $(\\nabla^2\\Psi + SY^{-1})\\Delta y - R^T\\Delta\\nu = -(\\nabla\\phi_\\tau -
    R^T\\nu)$, $R\\Delta y = -r^p$ (`_newton_direction` with $E = y/s$; the duals start at
    $s = \\tau w/y$ and then take their own Newton step
    $\\Delta s = \\tau w/y - s - s\\Delta y/y$, at most 0.995 of the way to $s = 0$). For any
    $s > 0$ this is a descent direction of the merit
    $\\psi(\\alpha) = \\phi_\\tau(y + \\alpha\\Delta y) + \\rho(1-\\alpha)\\|r^p\\|_1$,
    $\\rho > \\|\\nu + \\Delta\\nu\\|_\\infty$; the step is at most 0.995 of the way to the boundary of
    $y \\ge 0$ and 0.8 (`_CAP_FRAC`) of the way to $z \\le \\bar\\mu$ and halves until the
    trapezoid estimate of the decrease of $\\psi$ (from its slope alone, so no potential
    values are needed) passes Armijo's test. The weight $\\tau$ is chosen per iteration by a
    Mehrotra-type predictor: the affine-scaling direction (same factored Schur system)
    gives $\\mu_{aff}$, and $\\tau = \\sigma\\mu$ with $\\mu = \\sum ys/\\sum w$ and
    $\\sigma = (\\mu_{aff}/\\mu)^3$, floored at `_KAPPA` times the relative demand residual.
    The stage ends when the point is feasible with per-source duality gap $\\mu\\deg(i)$ and
    relative dual residual $|c - \\nu - s|/\\bar c$ below `_IPM_SWITCH` (`_IPM_TOL` on a
    second try), or the line search fails, or after `max_iters` (then stage 2 only scores
    the point).

    **Stage 2, polish** (`phase = 1`, at most `_POLISH_ITERS` iterations, fewer once the
    scaled residual is below `_POLISH_DONE`): the support is the set
    of arcs with $y_{ij}/\\lambda_i \\ge s_{ij}/\\bar c_i$. Newton steps on the equality system
    $f_j(N_j) + g_{ij} = \\nu_i$ (support), $\\sum_j y_{ij} = \\lambda_i$, $h_j(N_j, z_j) = 0$
    (the flow balance in the form of `_Problem.cells`, so no inverse is needed), through
    the same Schur system with $E_{ij} = 1/(\\epsilon\\tilde P_j)$ (a proximal term that
    only selects among equivalent flows on cycles of the support). Small flows that a step
    would drive negative leave the support without a step; otherwise a ratio test drops
    the first arc to reach zero; arcs with a clearly negative reduced cost join. The best
    point seen (smallest scaled residual) is kept. If the first polish (started at gap
    `_IPM_SWITCH`) ends with that residual above `_RETRY * tol`, stage 1 resumes once from
    the point it left, now down to `_IPM_TOL` (theory/equilibria.md §3.1).
    """
    pb = _make_problem(scn, lam, cost)
    A, src, g = pb.A, pb.src, pb.g
    lam = pb.lam
    cap = scn.service.capacity
    lsrc = jnp.where(src, lam, 1.0)
    deg = jnp.max(jnp.sum(A, axis=1))

    def levels(c):
        cs = jnp.maximum(jnp.max(jnp.where(A, c, 0.0)), _TINY)
        cbar = jnp.where(src, jnp.min(jnp.where(A, c, jnp.inf), axis=1), 1.0)
        return jnp.maximum(cbar, 1e-12 * cs), cs

    # Start: capacity-weighted routing, scaled so that every cell is at most half full.
    w0 = jnp.where(A, cap[None, :], 0.0)
    x0 = w0 / jnp.maximum(jnp.sum(w0, axis=1, keepdims=True), _TINY)
    z0 = jnp.sum(lam[:, None] * x0, axis=0)
    ratio = jnp.where(z0 > 0, cap / jnp.where(z0 > 0, z0, 1.0), jnp.inf)
    t0 = jnp.minimum(1.0, 0.5 * jnp.min(ratio))
    y0 = jnp.where(A, t0 * lam[:, None] * x0, 0.0)
    zero_n = jnp.zeros_like(lam)
    # Stage 1 keeps N exact: here, then through the line search (which returns the
    # workloads of the accepted point).
    N0 = jnp.where(jnp.any(A, axis=0), inverse_rate(scn.service, jnp.sum(y0, axis=0)), 0.0)
    st0 = dict(
        y=y0,
        s=jnp.zeros_like(y0),
        nu=zero_n,
        N=N0,
        w=jnp.zeros_like(y0),
        tau=jnp.asarray(1.0, lam.dtype),
        it=jnp.asarray(0),
        phase=jnp.asarray(0),
        pol=jnp.asarray(0),
        act=A,
        best_y=y0,
        best_N=zero_n,
        best_m=jnp.asarray(jnp.inf, lam.dtype),
        fresh=jnp.asarray(True),
        converged=jnp.asarray(False),
        ptot=jnp.asarray(0),
        retry=jnp.asarray(True),
        keep=dict(y=y0, s=jnp.zeros_like(y0), nu=zero_n, N=N0, w=jnp.zeros_like(y0)),
        keep_tau=jnp.asarray(1.0, lam.dtype),
    )

    def cond_ipm(st):
        return st["phase"] == 0

    def cond_polish(st):
        # One more pass than there are polish steps: the last pass only scores its point.
        # Under vmap the loop runs until every scenario is done: a scenario whose polish
        # has reached rounding level stops early.
        return (st["phase"] == 1) & (st["pol"] <= _POLISH_ITERS) & (st["best_m"] > _POLISH_DONE)

    def body(st, stage1: bool):
        # One loop per stage: `ipm` is a constant of each loop's body, so the compiled
        # body of each stage carries only that stage's work.
        y, s, nu, N, w, tau = st["y"], st["s"], st["nu"], st["N"], st["w"], st["tau"]
        ipm = jnp.asarray(stage1)
        z = jnp.sum(jnp.where(A, y, 0.0), axis=0)
        # Stage 1 keeps N exact; stage 2 carries N as an unknown of the joint system
        # (cells left without active arcs have z = 0 and so N = 0 exactly).
        act = jnp.where(ipm, A, st["act"])
        fed = jnp.any(act, axis=0)
        N = jnp.where(fed, N, 0.0)
        Fc, h, hN, ell, dF = pb.cells(N, z)
        c = Fc[None, :] + g
        cbar, cs = levels(c)
        if stage1:
            # Barrier weights from the current cost levels (every iteration).
            w = jnp.where(A, (lsrc * cbar)[:, None], 0.0)
        # First iteration: dual estimates from the starting point.
        ysafe = jnp.where(A, y, 1.0)
        # Reciprocals of the flows (and below of the duals), formed once per pass: the
        # divisions over the (n, n) arcs are the most expensive elementwise work.
        iy = 1.0 / ysafe
        s = jnp.where(st["fresh"], jnp.where(A, tau * w * iy, 0.0), s)
        red = c - nu[:, None]
        act = act | (~ipm & A & (red < -1e-9 * cbar[:, None]))
        rp = jnp.where(src, jnp.sum(jnp.where(act, y, 0.0), axis=1) - lam, 0.0)
        Pt = jnp.clip(dF * ell / jnp.maximum(hN, _TINY), _TINY, _HUGE)
        Pmax = jnp.max(jnp.where(fed, Pt, 0.0))
        i_s = 1.0 / jnp.where(A, s, 1.0)
        E = jnp.where(
            ipm,
            jnp.where(A, ysafe * i_s, 0.0),
            # (the proximal weight uses the curvature floored at 1e-6 of the largest, so
            # that a nearly flat cell, e.g. one of huge capacity, does not make E explode)
            jnp.where(act, 1.0 / (_POLISH_REG * jnp.maximum(Pt, 1e-6 * Pmax)[None, :]), 0.0),
        )
        if stage1:
            # Mehrotra-type predictor: the affine-scaling direction (barrier weight 0) on
            # the factored Schur system; the weight of the step is sigma * mu with
            # sigma = (mu_aff / mu)^3 (theory/equilibria.md §3.1).
            sw = jnp.sum(w) + _TINY
            mu = jnp.sum(jnp.where(A, y * s, 0.0)) / sw
            sch = _schur(E, Pt, src)
            dy_a, _ = sch.solve(jnp.where(A, red, 0.0), rp)
            ds_a = jnp.where(A, -s - s * dy_a * iy, 0.0)
            ap = jnp.minimum(
                1.0,
                jnp.minimum(
                    _step_to_boundary_inv(iy, dy_a, A),
                    _step_to_boundary(cap - z, -jnp.sum(dy_a, axis=0), fed),
                ),
            )
            ad = jnp.minimum(1.0, _step_to_boundary_inv(i_s, ds_a, A))
            mu_a = jnp.sum(jnp.where(A, (y + ap * dy_a) * (s + ad * ds_a), 0.0)) / sw
            sigma = jnp.clip((jnp.maximum(mu_a, 0.0) / jnp.maximum(mu, _TINY)) ** 3, 0.0, 1.0)
            # Safeguard: the weight stays above a fraction of the relative demand residual,
            # so that complementarity cannot reach zero long before feasibility does.
            infeas = jnp.max(jnp.abs(rp) / lsrc)
            tau = jnp.maximum(sigma * mu, jnp.minimum(mu, _KAPPA * infeas))
            # Corrector: the barrier step at weight tau, same factors (the right-hand side
            # red - tau w / y is formed first: combining two solves would cancel).
            dy, dnu = sch.solve(jnp.where(A, red - tau * w * iy, 0.0), rp)
        else:
            q = jnp.where(act, red, 0.0)
            shift = jnp.where(fed, -dF * h / jnp.maximum(hN, _TINY), 0.0)
            dy, dnu = _newton_direction(E, q + jnp.where(A, shift[None, :], 0.0), rp, Pt, src)
        bw = jnp.where(A, tau * w, 0.0)
        dz = jnp.sum(dy, axis=0)
        dN = jnp.where(fed, (ell * dz - h) / jnp.maximum(hN, _TINY), 0.0)
        nun = nu + dnu

        # ---- stage 1: barrier step with a slope-only backtracking line search ----
        amax = jnp.minimum(
            1.0,
            jnp.minimum(
                0.995 * _step_to_boundary_inv(iy, dy, A),
                _CAP_FRAC * _step_to_boundary(cap - z, -dz, fed),
            ),
        )
        rho = 2.0 * jnp.max(jnp.where(src, jnp.abs(nun), 0.0)) + cs
        rp1 = jnp.sum(jnp.abs(rp))
        d0 = jnp.minimum(jnp.sum(jnp.where(A, (c - bw * iy) * dy, 0.0)) - rho * rp1, 0.0)
        # Armijo through the trapezoid rule, with room for the rounding error of the slope
        # (near the barrier minimiser the slope is at the level of its own rounding).
        noise = 1e-12 * jnp.sum(jnp.where(A, jnp.abs(c * dy) + jnp.abs(bw * iy * dy), 0.0))
        thresh = -(1.0 - 4e-4) * d0 + noise
        # No descent left above the rounding level: the barrier problem is solved, so the
        # primal step is skipped (the duals still move).
        flat = d0 >= -noise

        def bt_cond(cr):
            # Under vmap the loop runs while any scenario needs it: scenarios in stage 2
            # must not keep it going.
            _, da, _, _, k = cr
            return ipm & ~flat & (da > thresh) & (k < 30)

        # First-order prediction of the workloads along the step (warm start of the
        # inverse): dN = dz / mu'(N) on the flow balance.
        dN_lin = jnp.where(fed, ell * dz / jnp.maximum(hN, _TINY), 0.0)

        def bt_body(cr):
            a, _, _, _, k = cr
            a = jnp.where(k == 0, amax, 0.5 * a)
            yt = jnp.where(A, y + a * dy, 1.0)
            zt = jnp.sum(jnp.where(A, yt, 0.0), axis=0)
            Nt = jnp.where(fed, inverse_rate(scn.service, zt, N + a * dN_lin), 0.0)
            ct = destination_cost(pb.cost, scn, Nt)[None, :] + g
            da = jnp.sum(jnp.where(A, (ct - bw / yt) * dy, 0.0)) - rho * rp1
            return a, jnp.where(jnp.isfinite(da), da, jnp.inf), Nt, ct, k + 1

        a, da, Nt, ct, _ = jax.lax.while_loop(
            bt_cond, bt_body, (amax, jnp.asarray(jnp.inf, lam.dtype), N, c, jnp.asarray(0))
        )
        good = (da <= thresh) & ~flat
        y1 = jnp.where(good, jnp.where(A, y + a * dy, 0.0), y)
        N1 = jnp.where(good, Nt, N)
        rp_new = jnp.where(good, (1.0 - a) * rp, rp)
        feas = jnp.max(jnp.abs(rp_new) / lsrc) <= _IPM_FEAS
        cbar1, _ = levels(jnp.where(good, ct, c))
        w1 = jnp.where(A, (lsrc * cbar1)[:, None], 0.0)
        # Dual step of the primal-dual system: S dy + Y ds = tau w - Y S, at most 0.995 of
        # the way to s = 0 (also taken when the primal step is flat).
        ds = jnp.where(A, (bw - s * dy) * iy - s, 0.0)
        a_s = jnp.minimum(1.0, 0.995 * _step_to_boundary_inv(i_s, ds, A))
        s1 = jnp.where(good | flat, jnp.where(A, s + a_s * ds, 0.0), s)
        # Complementarity gap of the new point, per unit weight.
        tau1 = jnp.sum(jnp.where(A, y1 * s1, 0.0)) / (jnp.sum(w1) + _TINY)
        # Dual residual of the new point: its costs against the multipliers and duals.
        rd = jnp.max(jnp.where(A, jnp.abs(ct - nun[:, None] - s1), 0.0) * (1.0 / cbar1)[:, None])
        gap_tol = jnp.where(st["retry"], _IPM_SWITCH, _IPM_TOL)
        conv = feas & (tau1 * deg <= gap_tol) & (rd <= _RD * gap_tol)
        end_ipm = conv | ~(good | flat) | (st["it"] + 1 >= max_iters)
        # Support for stage 2: y_ij / lambda_i against s_ij / cbar_i, plus the largest arc
        # of every source; everything else is switched off.
        # (with w1 = lambda_i cbar_i on A this reads y_ij >= sqrt(tau1) lambda_i)
        sup = A & (y1 >= jnp.sqrt(tau1) * lsrc[:, None])
        top = jnp.max(jnp.where(A, y1, -jnp.inf), axis=1)
        sup = sup | (A & (y1 >= top[:, None]))

        # ---- stage 2: active-set Newton step ----
        # Scaled residual of the current point, to keep the best one.
        m_cur = jnp.maximum(
            jnp.maximum(
                jnp.max(jnp.abs(jnp.where(act, red, 0.0)) / cbar[:, None]),
                jnp.max(jnp.abs(rp) / lsrc),
            ),
            jnp.maximum(
                jnp.max(jnp.where(fed, jnp.abs(h) / (N + z * ell + _TINY), 0.0)),
                jnp.max(jnp.where(A & ~act, -red / cbar[:, None], 0.0)),
            ),
        )
        better = ~ipm & (m_cur < st["best_m"])
        neg = act & (y + dy < 0.0)
        small = neg & (y <= 1e-4 * lsrc[:, None])
        drop = jnp.any(small)
        a_dom = 0.9 * jnp.minimum(
            _step_to_boundary(cap - z, -dz, fed), _step_to_boundary(N, dN, fed)
        )
        a2 = jnp.where(
            drop, 0.0, jnp.minimum(1.0, jnp.minimum(_step_to_boundary(y, dy, act), a_dom))
        )
        y2 = jnp.where(act & ~small, y + a2 * dy, 0.0)
        act2 = act & ~small & (y2 > 0.0)
        y2 = jnp.where(act2, y2, 0.0)

        def pick(a1, a2):
            return jnp.where(ipm, a1, a2)

        # Early polish that failed: resume stage 1 from the point it left (once).
        best_m = jnp.where(better, m_cur, st["best_m"])
        back = ~ipm & st["retry"] & (st["pol"] >= _POLISH_ITERS) & (best_m > _RETRY * tol)
        keep_now = ipm & end_ipm & conv
        keep = st["keep"]
        nu_ipm = jnp.where(good, nun, nu)
        keep = jax.tree_util.tree_map(
            lambda new, old: jnp.where(keep_now, new, old),
            dict(y=y1, s=s1, nu=nu_ipm, N=N1, w=w1),
            keep,
        )
        out = dict(
            y=pick(jnp.where(end_ipm, jnp.where(sup, y1, 0.0), y1), y2),
            s=pick(s1, s),
            nu=pick(nu_ipm, nu + a2 * dnu),
            N=pick(N1, jnp.where(fed, N + a2 * dN, 0.0)),
            w=pick(w1, w),
            tau=pick(tau1, tau),
            it=st["it"] + ipm.astype(st["it"].dtype),
            phase=jnp.where(ipm & end_ipm, 1, st["phase"]),
            # A stage 1 stopped by `max_iters` gets only the scoring pass of stage 2.
            pol=jnp.where(
                ipm & end_ipm & ~conv & (st["it"] + 1 >= max_iters),
                _POLISH_ITERS,
                st["pol"] + (~ipm).astype(st["pol"].dtype),
            ),
            act=pick(sup, act2),
            best_y=jnp.where(better, y, st["best_y"]),
            best_N=jnp.where(better, N, st["best_N"]),
            best_m=best_m,
            fresh=jnp.asarray(False),
            converged=st["converged"] | (ipm & conv),
            ptot=st["ptot"] + (~ipm).astype(st["pol"].dtype),
            retry=st["retry"] & ~back & ~(ipm & end_ipm & ~conv),
            keep=keep,
            keep_tau=jnp.where(keep_now, tau1, st["keep_tau"]),
        )
        resume = dict(keep, tau=st["keep_tau"], phase=0, pol=0, act=A)
        for k, v in resume.items():
            out[k] = jnp.where(back, v, out[k])
        return out

    def finish(st):
        cert = _certify(pb, st["best_y"], st["best_N"])
        cert["iterations"] = st["it"] + st["ptot"]
        # success: certified; not_converged: the interior point stopped early (iteration
        # cap or failed line search) or the certificate is above tol; nonfinite: a
        # converged run that still produced a non-finite value.
        status = jnp.where(
            cert["kkt_residual"] <= tol,
            EQ_STATUS["success"],
            jnp.where(
                ~cert["finite"] & st["converged"],
                EQ_STATUS["nonfinite"],
                EQ_STATUS["not_converged"],
            ),
        )
        cert.pop("finite")
        cert["status"] = status
        return cert

    return _Stages(st0, cond_ipm, cond_polish, body, finish)


class _Stages(NamedTuple):
    st0: dict
    cond_ipm: Callable
    cond_polish: Callable
    body: Callable
    finish: Callable

    def ipm(self, st):
        """Stage 1 to its end (no pass if the scenario is not in stage 1)."""
        return jax.lax.while_loop(self.cond_ipm, lambda st: self.body(st, True), st)

    def polish(self, st):
        return jax.lax.while_loop(self.cond_polish, lambda st: self.body(st, False), st)


def _solve_one(scn: Scenario, lam, tol, max_iters, *, cost: str):
    """Interior point, then polish, then (only for scenarios whose early polish failed)
    both again, for one scenario (theory/equilibria.md §3; the stages are `_stages`)."""
    S = _stages(scn, lam, tol, max_iters, cost=cost)
    st = S.polish(S.ipm(S.st0))
    return S.finish(S.polish(S.ipm(st)))


# Sub-batch sizes (fractions of one device's batch) through which a stage's stragglers
# are compacted (`_solve_local`). Compaction triples the compile time (about 5 to 15 s
# per cost on 2 CPU cores), which only pays on large batches: batches below
# _COMPACT_MIN scenarios per device are not compacted.
_COMPACT_LEVELS = (4, 16)
_COMPACT_MIN = 128


def _tree_where(on, new, old):
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(on.reshape(on.shape + (1,) * (a.ndim - 1)), a, b), new, old
    )


def _compacted(each, cond, step, args, st, sizes):
    """Run a stage (`step(S)(st)` while `cond(S)(st)`) to its end on every scenario of the
    batch `args = (scn, lam)`, compacting its stragglers.

    The batch makes passes only while more than `sizes[0]` of its scenarios are still in
    the stage; those left are gathered into a sub-batch of that size (padded with copies
    of a scenario that is not in the stage, on which no pass is made), which continues
    the same way with `sizes[1:]`, and the last one runs to the end. The results are
    scattered back. Each scenario makes exactly the passes it would make alone.
    """
    in_stage = each(lambda S, st: cond(S)(st))
    if not sizes:
        return each(lambda S, st: jax.lax.while_loop(cond(S), step(S), st))(*args, st)
    C = sizes[0]

    def one_pass(st):
        new = each(lambda S, st: step(S)(st))(*args, st)
        return _tree_where(in_stage(*args, st), new, st)

    st = jax.lax.while_loop(lambda st: jnp.sum(in_stage(*args, st)) > C, one_pass, st)
    todo = in_stage(*args, st)
    # at most C scenarios are left and at least one is not (C < batch): pad with that one
    idx = jnp.nonzero(todo, size=C, fill_value=jnp.argmin(todo))[0]
    sub_args, sub_st = jax.tree_util.tree_map(lambda a: a[idx], (args, st))
    sub_st = _compacted(each, cond, step, sub_args, sub_st, sizes[1:])
    return jax.tree_util.tree_map(lambda a, b: a.at[idx].set(b), st, sub_st)


def _solve_local(scn, lam, tol, max_iters, *, cost: str):
    """`_solve_one` over a batch (one device's shard), with each stage's stragglers
    compacted (`_compacted`).

    Under `vmap` a convergence loop runs until its slowest scenario is done, and every
    pass costs the whole batch. The passes vary (on 10-cell networks, 10-21 interior-point
    passes for the Wardrop cost, mean 14), so each stage runs on the full batch only while
    more than a quarter of it is still in that stage, then on a quarter-size sub-batch
    while more than a sixteenth is, then on a sixteenth-size one (`_COMPACT_LEVELS`).
    Each scenario follows exactly the passes of `_solve_one`; only the batch it shares a
    pass with changes.
    """
    B = lam.shape[0]
    if B < _COMPACT_MIN:
        return jax.vmap(lambda s, l: _solve_one(s, l, tol, max_iters, cost=cost))(scn, lam)
    sizes = tuple(max(B // f, 1) for f in _COMPACT_LEVELS)

    def each(f):
        return jax.vmap(lambda s, l, *a: f(_stages(s, l, tol, max_iters, cost=cost), *a))

    def stage(cond, stage1):
        step = lambda S: functools.partial(S.body, stage1=stage1)  # noqa: E731
        return lambda st: _compacted(each, cond, step, (scn, lam), st, sizes)

    ipm = stage(lambda S: S.cond_ipm, True)
    polish = stage(lambda S: S.cond_polish, False)
    st = each(lambda S: S.st0)(scn, lam)
    # Two rounds, as in `_solve_one`: the second only for scenarios whose early polish
    # failed (few: its loops go straight to the smallest sub-batch). One traced round
    # serves both, which halves the compile time.
    st = jax.lax.fori_loop(0, 2, lambda _, st: polish(ipm(st)), st)
    return each(lambda S, st: S.finish(st))(scn, lam, st)


def _solve_batch_impl(scn, lam, tol, max_iters, *, cost):
    _TRACES[cost] += 1
    # tol and max_iters are closed over (replicated); only the batch is split per device,
    # so each device runs its own convergence loops (`per_device`).
    return per_device(functools.partial(_solve_local, tol=tol, max_iters=max_iters, cost=cost))(
        scn, lam
    )


# The compiled batched solver, with the solvers' XLA options.
_solve_batch = solver_jit(_solve_batch_impl, static_argnames=("cost",))


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------


class EquilibriumSolution(eqx.Module):
    """An equilibrium of one cost family (batched: a leading axis `B` on every array).

    **Fields** (`n` cells):
    - `x`: `(n, n)` routing $x^*_{ij}$ (not unique in general; `N` and `z` are, Lemma 1).
    - `z`: `(n,)` arrival flow $z^*_j = \\sum_i\\lambda_ix^*_{ij}$; `N`: `(n,)` workloads
      $N^*_j = \\mu_j^{-1}(z^*_j)$.
    - `multipliers`: `(n,)` the common cost $c_i = \\sum_j x_{ij}c_{ij}(N_j)$ of each source.
    - `objective`: $\\Psi(x^*)$; `social_cost`: $\\sum_jN_j + \\sum_{ij}2\\tau_{ij}\\lambda_ix_{ij}$;
      `mean_latency`: social cost / $\\Lambda$ (Little's law).
    - certificate: `kkt_residual`, `flow_residual`, `slackness_max_used`,
      `slackness_min_allowed`, `duality_gap` (definitions in theory/equilibria.md §2).
    - `iterations`: interior-point plus polish iterations; `status`: `EQ_STATUS` code.
    """

    x: Float[Array, "... n n"]
    z: Float[Array, "... n"]
    N: Float[Array, "... n"]
    multipliers: Float[Array, "... n"]
    objective: Float[Array, "..."]
    social_cost: Float[Array, "..."]
    mean_latency: Float[Array, "..."]
    kkt_residual: Float[Array, "..."]
    flow_residual: Float[Array, "..."]
    slackness_max_used: Float[Array, "..."]
    slackness_min_allowed: Float[Array, "..."]
    duality_gap: Float[Array, "..."]
    iterations: Int[Array, "..."]
    status: Int[Array, "..."]
    cell_mask: Bool[Array, "... n"]
    cost: str = eqx.field(static=True, default="")
    cell_names: tuple[str, ...] = eqx.field(static=True, default=())

    def status_names(self) -> np.ndarray:
        return np.vectorize(EQ_STATUS_NAMES.get)(np.asarray(self.status))

    def raise_for_status(self) -> None:
        st = np.atleast_1d(np.asarray(self.status))
        bad = np.nonzero(st != EQ_STATUS["success"])[0]
        if bad.size:
            codes = sorted(set(st[bad].tolist()))
            kkt = np.atleast_1d(np.asarray(self.kkt_residual))[bad]
            raise EquilibriumError(
                f"{self.cost} equilibrium: {bad.size} scenario(s) failed (indices "
                f"{bad[:10].tolist()}, KKT residuals {kkt[:10].tolist()}): "
                + "; ".join(EQ_STATUS_MESSAGES[c] for c in codes)
            )

    def summary(self) -> dict:
        """The JSON record of `dlbfluid equilibrium --json` (one unbatched solution)."""
        if self.status.ndim != 0:
            raise ValueError("summary() needs an unbatched EquilibriumSolution; index it first")
        n = int(np.asarray(self.cell_mask).sum())
        return {
            "cost": self.cost,
            "N": np.asarray(self.N)[:n].tolist(),
            "z": np.asarray(self.z)[:n].tolist(),
            "x": np.asarray(self.x)[:n, :n].tolist(),
            "multipliers": np.asarray(self.multipliers)[:n].tolist(),
            "objective": float(self.objective),
            "mean_latency": float(self.mean_latency),
            "social_cost": float(self.social_cost),
            "kkt_residual": float(self.kkt_residual),
            "flow_residual": float(self.flow_residual),
            "slackness_max_used": float(self.slackness_max_used),
            "slackness_min_allowed": float(self.slackness_min_allowed),
            "duality_gap": float(self.duality_gap),
            "iterations": int(self.iterations),
            "status": EQ_STATUS_NAMES[int(self.status)],
            "cells": list(self.cell_names),
        }


def _bucket(n: int) -> int:
    """Cell count an unbatched scenario is padded to (4, 8, 16, ...): scenarios of nearby
    sizes share one compiled solver."""
    b = 4
    while b < n:
        b *= 2
    return b


def _batch_bucket(B: int, ndev: int) -> int:
    """Batch size a batch is padded to: 8 up to 8 scenarios, then a multiple of 64, and
    always a multiple of the device count (the batch axis is sharded over devices)."""
    b = 8 if B <= 8 else -(-B // 64) * 64
    return -(-b // ndev) * ndev


def _constant_copy(scn: Scenario, lam: np.ndarray) -> Scenario:
    """The same network with constant arrival rates `lam` (for the capacity check)."""
    lamj = jnp.asarray(lam)[:, None]
    return dataclasses.replace(scn, arrival_times=jnp.zeros_like(lamj), arrival_rates=lamj)


def _check_overload(scn: Scenario, time: float) -> None:
    """Assumption 2 at time `time`, for one scenario or every scenario of a batch.

    A capacity-weighted routing that is strictly feasible proves feasibility at once;
    only the other scenarios go through the max-flow test of `check_capacity`.
    """
    batched = len(scn.batch_shape) > 0
    times = np.asarray(scn.arrival_times)
    rates = np.asarray(scn.arrival_rates)
    allowed = np.asarray(scn.allowed)
    mask = np.asarray(scn.cell_mask)
    cap = np.asarray(scn.service.capacity)
    if not batched:
        times, rates, allowed, mask, cap = (a[None] for a in (times, rates, allowed, mask, cap))
    B, n, P = times.shape
    lam = np.empty((B, n))
    for b in range(B):
        for i in range(n):
            lam[b, i] = np.interp(time, times[b, i], rates[b, i])
    lam = np.where(mask, lam, 0.0)
    arcs = allowed & mask[:, :, None] & mask[:, None, :]
    w = np.where(arcs, cap[:, None, :], 0.0)
    tot = w.sum(axis=2, keepdims=True)
    x = np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), 0.0)
    z = np.einsum("bi,bij->bj", lam, x)
    stranded = (lam > 0) & (tot[..., 0] <= 0)
    quick = np.all(np.where(mask, z < cap * (1.0 - 1e-9), True), axis=1) & ~stranded.any(axis=1)
    for b in np.nonzero(~quick)[0]:
        one = scn if not batched else jax.tree_util.tree_map(lambda a: a[b], scn)
        try:
            check_capacity(_constant_copy(one, lam[b]))
        except OverloadError as e:
            if batched:
                raise OverloadError(
                    f"scenario {b} of the batch: {e}",
                    cells=e.cells,
                    sources=e.sources,
                    demand=e.demand,
                    capacity=e.capacity,
                ) from None
            raise


@eqx.filter_jit
def _prepare(scn: Scenario, time, Bb: int) -> Scenario:
    """float64 arrays, constant rates $\\lambda(\\texttt{time})$ (so the profile length is
    not a shape of the compiled solver) and the batch padded to `Bb` with copies of its
    last scenario; one compiled call instead of many small dispatches."""
    scn = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, scn
    )
    lam = jax.vmap(lambda s: s.arrival_rate(time))(scn)
    scn = dataclasses.replace(
        scn, arrival_times=jnp.zeros_like(lam)[..., None], arrival_rates=lam[..., None]
    )
    B = scn.batch_shape[0]
    if Bb > B:
        scn = jax.tree_util.tree_map(
            lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], Bb - B, 0)]), scn
        )
    return scn


@eqx.filter_jit
def _take(tree, B: int):
    """The first `B` scenarios of every array (one compiled call)."""
    return jax.tree_util.tree_map(lambda a: a[:B], tree)


def solve_equilibrium(
    scenario: Scenario,
    cost: str,
    *,
    tol: float = 1e-10,
    max_iters: int = 200,
    time: float = 0.0,
    throw: bool | None = None,
    check: bool = True,
) -> EquilibriumSolution:
    """Equilibrium of the cost family `cost` as the minimiser of the convex program (12).

    $\\min_{x \\in \\mathcal X} \\Psi(x) = \\sum_j p_j(z_j) + \\sum_{(i,j)} g_{ij}\\lambda_ix_{ij}$,
    $z_j = \\sum_i\\lambda_ix_{ij} < \\bar\\mu_j$, $p_j(z) = \\int_0^z f_j(\\mu_j^{-1}(s))ds$
    (seed §4, App. C.2; theory/equilibria.md). `rif` gives equal RIF per replica,
    `latency` the Wardrop equilibrium, `gradient` the social optimum (minimum mean
    end-to-end latency).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
    - `cost`: `"rif"`, `"latency"` or `"gradient"`.
    - `tol`: KKT residual below which a scenario reports `success`.
    - `max_iters`: interior-point iteration cap (a polish of at most 8 Newton steps
      follows).
    - `time`: arrival rates are $\\lambda_i(\\texttt{time})$ of each profile.
    - `throw`: raise `EquilibriumError` on a failed scenario; default True unbatched,
      False for a batch (failures are then reported in `status`).
    - `check`: test Assumption 2 first (set False only for inputs known to be feasible).

    **Returns:** an `EquilibriumSolution`, batched iff `scenario` is.

    **Raises:** `ValueError` for an unknown cost or bad options; `OverloadError` naming
    the overloaded cells and sources when no routing serves the demand within capacity.
    """
    check_cost(cost)
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol = {tol!r} is invalid: expected a finite number > 0")
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
        raise ValueError(f"max_iters = {max_iters!r} is invalid: expected an integer >= 1")
    if not (isinstance(time, (int, float)) and math.isfinite(time)):
        raise ValueError(f"time = {time!r} is invalid: expected a finite number")
    if len(scenario.batch_shape) > 1:
        raise ValueError(f"scenario batch shape {scenario.batch_shape}: expected at most one axis")
    batched = len(scenario.batch_shape) == 1
    if check:
        _check_overload(scenario, float(time))
    n = scenario.n_cells
    if batched:
        scn = scenario.strip()
    else:
        scn = pad_scenario(scenario, _bucket(n)).strip()
        scn = jax.tree_util.tree_map(lambda a: a[None], scn)
    B = scn.batch_shape[0]
    # Pad the batch to a bucket size that is a multiple of the device count, so that
    # nearby batch sizes (and every unbatched call) share one compiled solver.
    ndev = jax.device_count()
    Bb = _batch_bucket(B, ndev)
    scn = _prepare(scn, jnp.asarray(time, jnp.float64), Bb)
    scn = shard_batch(scn)
    lam = scn.arrival_rates[..., 0]
    out = _solve_batch(
        scn,
        lam,
        jnp.asarray(tol, jnp.float64),
        jnp.asarray(max_iters, jnp.int32),
        cost=cost,
    )
    out, mask = _take((out, scn.cell_mask), B)
    sol = EquilibriumSolution(
        cell_mask=mask,
        cost=cost,
        cell_names=tuple(scenario.cell_names) if not batched else (),
        **out,
    )
    if not batched:
        sol = jax.tree_util.tree_map(lambda a: a[0], sol)
        sol = _unpad(sol, n)
    if throw is None:
        throw = not batched
    if throw:
        sol.raise_for_status()
    return sol


def _unpad(sol: EquilibriumSolution, n: int) -> EquilibriumSolution:
    return eqx.tree_at(
        lambda s: (s.x, s.z, s.N, s.multipliers, s.cell_mask),
        sol,
        (sol.x[:n, :n], sol.z[:n], sol.N[:n], sol.multipliers[:n], sol.cell_mask[:n]),
    )


def price_of_anarchy(scenario: Scenario, **kwargs) -> dict:
    """Price of anarchy of the Wardrop (latency) and RIF equilibria, per scenario.

    $\\mathrm{PoA}_c = C(x^c)/C(x^{grad})$ with the social cost
    $C(x) = \\sum_jN_j + \\sum_{ij}2\\tau_{ij}\\lambda_ix_{ij}$ (theory/equilibria.md §5).

    **Arguments:** `scenario` (unbatched or batched) and the keyword options of
    `solve_equilibrium`.

    **Returns:** `{"latency": ratio, "rif": ratio, "equilibria": {cost: EquilibriumSolution}}`.
    """
    sols = {c: solve_equilibrium(scenario, c, **kwargs) for c in ("gradient", "latency", "rif")}
    opt = sols["gradient"].social_cost
    return {
        "latency": sols["latency"].social_cost / opt,
        "rif": sols["rif"].social_cost / opt,
        "equilibria": sols,
    }
