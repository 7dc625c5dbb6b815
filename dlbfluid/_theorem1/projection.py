"""The projection check: the drift inequality integrated along one trajectory, in the tick
model's own pairing (theory/lyapunov.md, *The projection check*).

$$\\int_0^T\\sum_jD_j \\le [R + \\Phi](0) - [R + \\Phi](T) - \\int_0^T\\sum_i\\lambda_iS_i^\\tau
+ \\int_0^T\\sum_{ij}\\lambda_i\\Gamma_{ij}$$

reduces, term for term, to the projection inequality of the routers' steps
$(x^{k+1} - x^k)\\cdot(x^{k+1} - x^*) \\le -\\eta h\\,\\hat c^{k+1}\\cdot(x^{k+1} - x^*)$, which holds
for every cost vector, every step size and every reference point on the simplex. So it is
a diagnostic of the routers' steps (did they take projected steps on the costs of the
reference point's family, with the steps $R$ is weighted by?), never Theorem 1's verdict:
it holds on a limit cycle at three times $\\eta^*$ as well. Theorem 1's verdict is
`dlbfluid._theorem1.check`.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._costs import cost_from_name
from .lyapunov import (
    _check_per_tick,
    _cumtrapz,
    _delayed,
    _tick_pairs,
    workload_gap,
    workload_potential,
)


class ProjectionCheck(eqx.Module):
    """The integrated drift inequality along trajectories (arrays over the batch).

    **Fields:**
    - `lhs`: $\\int_0^T\\sum_jD_j$ (trapezoid rule on the per-tick saves).
    - `rhs`: `routing_start + workload_start - routing_end - workload_end - delay_gap +
      mismatch`.
    - `routing_start`, `routing_end`: $R(0)$, $R(T)$; `workload_start`, `workload_end`:
      $\\Phi(0)$, $\\Phi(T)$.
    - `delay_gap`: $\\int_0^T\\sum_i\\lambda_iS^\\tau_i$, the delayed routings' slackness.
    - `mismatch`: $\\int_0^T\\sum_{ij}\\lambda_i\\Gamma_{ij}$, in the tick model's pairing: the
      delayed routing against the current cost in continuous time, minus
      $h\\sum_{k=1}^{K}\\sum_i\\lambda_i(x^k_i - x^*_i)\\cdot\\hat c^k_i$, each routing against the
      observation it was computed from.
    - `tolerance`: the quadrature defect of the workload identity
      $\\Phi(T) - \\Phi(0) = \\int\\sum_j(f_j - f_j^*)(\\text{inflow}_j - \\mu_j)$, plus $10^{-6}$ of
      the terms' size: what `holds` allows for.
    - `discretisation_excess`: $\\max(0, \\text{lhs} - \\text{rhs}_c)$, $\\text{rhs}_c$ the same
      right-hand side read in continuous time from the saves (left-point rule, as
      `Diagnostics.drift_excess`): first order in the tick.
    - `holds`: `lhs <= rhs + tolerance`.
    """

    lhs: Float[Array, " B"]
    rhs: Float[Array, " B"]
    routing_start: Float[Array, " B"]
    workload_start: Float[Array, " B"]
    routing_end: Float[Array, " B"]
    workload_end: Float[Array, " B"]
    delay_gap: Float[Array, " B"]
    mismatch: Float[Array, " B"]
    tolerance: Float[Array, " B"]
    discretisation_excess: Float[Array, " B"]
    holds: Bool[Array, " B"]

    def record(self, b: int = 0) -> dict:
        """The JSON record of trajectory `b` (`verify`'s `projection_check`; `b` is ignored for
        the 0-d fields of one trajectory, `projection_check`)."""
        v = {}
        for f in dataclasses.fields(self):
            a = np.asarray(getattr(self, f.name))
            v[f.name] = a[b] if a.ndim else a
        return {
            "holds": bool(v["holds"]),
            "lhs": float(v["lhs"]),
            "rhs": float(v["rhs"]),
            "discretisation_excess": float(v["discretisation_excess"]),
            "tolerance": float(v["tolerance"]),
            "terms": {
                k: float(v[k])
                for k in (
                    "routing_start",
                    "workload_start",
                    "routing_end",
                    "workload_end",
                    "delay_gap",
                    "mismatch",
                )
            },
        }


def _projection_check_impl(cost, scn, N_star, x_star, eta, h, t, N, x):
    cost = cost_from_name(cost)
    K = t.shape[0] - 1
    lam = jnp.where(scn.cell_mask, scn.arrival_rate(0.0), 0.0)
    tau = jnp.where(scn.allowed, scn.latency, 0.0)
    g = jnp.where(scn.allowed, cost.arc(scn), 0.0)
    f_star = cost.destination(scn, N_star)
    c_star = jnp.where(scn.allowed, f_star[None, :] + g, 0.0)
    allowed = scn.allowed[None]
    dx = jnp.where(allowed, x - x_star[None], 0.0)  # (K+1, n, n)
    w = jnp.where(eta > 0, lam / (2.0 * jnp.where(eta > 0, eta, 1.0)), 0.0)
    R = jnp.sum(w[None] * jnp.sum(dx**2, axis=-1), axis=-1)
    Phi0 = workload_potential(cost, scn, N[0], N_star)
    PhiT = workload_potential(cost, scn, N[-1], N_star)
    gap = jnp.sum(workload_gap(cost, scn, N, N_star[None]), axis=-1)
    lhs = _cumtrapz(gap, t)[-1]
    f = cost.destination(scn, N)  # (K+1, n)

    prev, cur, r = _tick_pairs(dx, tau, h)  # (K, n, n) twice, (1, n, n)
    # f_j(N_j(t)) linear on each tick: its integral over [0, r) and [r, h).
    f0, f1 = f[:-1][:, None, :], f[1:][:, None, :]
    first = r * f0 + (f1 - f0) * r**2 / (2.0 * h)
    second = 0.5 * h * (f0 + f1) - first
    lam3 = lam[None, :, None]
    gk = g[None]
    seen_now = jnp.sum(lam3 * (prev * (first + gk * r) + cur * (second + gk * (h - r))))
    delay_gap = jnp.sum(lam3 * c_star[None] * (prev * r + cur * (h - r)))
    # Each routing x^k (k >= 1) with the observation c(N(t_k - tau)) it was computed from.
    N_del = _delayed(N, h, tau, jnp.arange(K + 1), piecewise_constant=False)
    c_seen = jnp.where(allowed, cost.destination(scn, N_del) + g[None], 0.0)
    paired = jnp.sum(lam[None, :, None] * dx * c_seen, axis=(-2, -1))  # (K+1,)
    mismatch = seen_now - h * jnp.sum(paired[1:])
    rhs = R[0] + Phi0 - R[-1] - PhiT - delay_gap + mismatch
    defect = (PhiT - Phi0) - (seen_now - delay_gap) + lhs
    size = R[0] + Phi0 + lhs + jnp.abs(delay_gap) + jnp.abs(mismatch)
    tol = jnp.abs(defect) + 1e-6 * size

    # The same inequality read in continuous time (left-point rule on ticks).
    x_del = _delayed(x, h, tau, jnp.arange(K + 1), piecewise_constant=True)
    dx_del = jnp.where(allowed, x_del - x_star[None], 0.0)
    c_now = jnp.where(allowed, f[:, None, :] + g[None], 0.0)
    slack_del = jnp.sum(lam[None, :, None] * dx_del * c_star[None], axis=(-2, -1))
    gamma = jnp.sum(lam[None, :, None] * (dx_del * c_now - dx * c_seen), axis=(-2, -1))
    dt = jnp.diff(t)
    rhs_c = R[0] + Phi0 - R[-1] - PhiT - jnp.sum(slack_del[:-1] * dt) + jnp.sum(gamma[:-1] * dt)
    return ProjectionCheck(
        lhs=lhs,
        rhs=rhs,
        routing_start=R[0],
        workload_start=Phi0,
        routing_end=R[-1],
        workload_end=PhiT,
        delay_gap=delay_gap,
        mismatch=mismatch,
        tolerance=tol,
        discretisation_excess=jnp.maximum(lhs - rhs_c, 0.0),
        holds=lhs <= rhs + tol,
    )


@eqx.filter_jit
def batch_projection_check(cost, scn, N_star, x_star, eta, h, t, N, x) -> ProjectionCheck:
    """`ProjectionCheck` of a batch of trajectories saved at every tick (leading axis on every
    argument but `cost`: the stripped scenarios, $N^*$, $x^*$, the per-router steps
    $\\eta_i$, the tick, `Solution.t`, `.N`, `.x`), one compile per shape. The runs are
    checked one after another (`jax.lax.map`): the per-tick temporaries of one run are
    alive at a time, not the batch's."""
    return jax.lax.map(
        lambda a: _projection_check_impl(cost, *a), (scn, N_star, x_star, eta, h, t, N, x)
    )


def projection_check(solution, scenario, equilibrium, *, cost: str, step_size) -> ProjectionCheck:
    """The projection check of one flow-routing trajectory (module docstring).

    **Arguments:** as `lyapunov_diagnostics`: an unbatched `Solution` saved at every tick,
    its `Scenario` (constant arrival rates), the equilibrium (`N`, `x`) of `cost`, and the
    step size $\\eta$ (scalar or per router).

    **Returns:** a `ProjectionCheck` of 0-d arrays.

    **Raises:** `ValueError` for a batched solution or one not saved at every tick.
    """
    t, h = _check_per_tick(solution)
    n = scenario.n_cells
    eta = jnp.broadcast_to(jnp.asarray(step_size, t.dtype), (n,))
    one = batch_projection_check(
        cost_from_name(cost),
        jax.tree_util.tree_map(lambda a: a[None], scenario.strip()),
        jnp.asarray(equilibrium.N)[None, ..., :n],
        jnp.asarray(equilibrium.x)[None, ..., :n, :n],
        eta[None],
        jnp.asarray(h, t.dtype)[None],
        t[None],
        jnp.asarray(solution.N)[None],
        jnp.asarray(solution.x)[None],
    )
    return jax.tree_util.tree_map(lambda a: a[0], one)
