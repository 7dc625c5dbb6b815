"""One scenario's equilibrium problem and the KKT certificate of a point (theory/equilibria.md
§1-§2)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._costs import AbstractCost, cost_from_name
from .._scenario import Scenario


def potential(cost, scn: Scenario, z, N):
    """$p_j(z_j) = \\int_0^{z_j} f_j(\\mu_j^{-1}(s))ds = \\int_0^{N_j} f_j(n)\\mu_j'(n)\\,dn$ of the
    cost family `cost` (`AbstractCost.potential`; closed forms and quadratures per service
    model in `dlbfluid._service`, theory/equilibria.md §1.2)."""
    return cost_from_name(cost).potential(scn, z, N)


_TINY = 1e-300


class _Problem(eqx.Module):
    """One scenario's program in the arc flows $y_{ij} = \\lambda_ix_{ij}$.

    **Fields:** `scn`; `lam` the demand $\\lambda$ (0 on padding); `g` the arc costs;
    `A` the arcs that may carry flow (allowed, between real cells, from a source with
    demand); `arcs` the allowed arcs between real cells; `src` the real cells with demand;
    `lsrc` $\\lambda$ with 1 off the sources; `deg` the most arcs of one source; `cost`.
    """

    scn: Scenario
    lam: Float[Array, " n"]
    g: Float[Array, "n n"]
    A: Bool[Array, "n n"]
    arcs: Bool[Array, "n n"]
    src: Bool[Array, " n"]
    lsrc: Float[Array, " n"]
    deg: Array
    cost: AbstractCost = eqx.field(static=True)

    @property
    def cap(self):
        return self.scn.service.capacity

    def levels(self, c):
        """`(cbar, cs)`: each source's cheapest arc cost $\\bar c_i$ (floored at 1e-12 of the
        largest, `cs`), the cost level of its barrier weights and scaled residuals."""
        A = self.A
        cs = jnp.maximum(jnp.max(jnp.where(A, c, 0.0)), _TINY)
        cbar = jnp.where(self.src, jnp.min(jnp.where(A, c, jnp.inf), axis=1), 1.0)
        return jnp.maximum(cbar, 1e-12 * cs), cs

    def cells(self, N, z):
        """Cell terms of the joint $(y, N)$ Newton system (theory/equilibria.md §3.2).

        The flow balance is $h_j(N_j, z_j) = N_j - z_j\\ell_j(N_j) = 0$ in each service
        model's cancellation-free form (`ServiceModel.balance`: affine in $N$ for M/M/1
        cells and nearly so for softplus cells). Returns $F = f(N)$, the residual $h$,
        $\\partial h/\\partial N$, $\\ell$ ($= -\\partial h/\\partial z$) and $f'(N)$.
        """
        h, hN, ell = self.scn.service.balance(N, z)
        Ne = jnp.maximum(N, 1e-300)
        F, dF = jax.jvp(lambda M: self.cost.destination(self.scn, M), (Ne,), (jnp.ones_like(Ne),))
        return F, h, hN, ell, dF


def _make_problem(scn: Scenario, lam, cost) -> _Problem:
    mask = scn.cell_mask
    arcs = scn.allowed & mask[:, None] & mask[None, :]
    lam = jnp.where(mask, lam, 0.0)
    src = mask & (lam > 0)
    A = arcs & src[:, None]
    cost = cost_from_name(cost)
    cost = cost_from_name(cost)
    return _Problem(
        scn=scn,
        lam=lam,
        g=cost.arc(scn),
        A=A,
        arcs=arcs,
        src=src,
        lsrc=jnp.where(src, lam, 1.0),
        deg=jnp.max(jnp.sum(A, axis=1)),
        cost=cost,
    )


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
    N = scn.service.inverse_rate(z, N_guess)
    F = pb.cost.destination(scn, N)
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
