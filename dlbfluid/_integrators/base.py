"""The integrator family: how the workload ODE is advanced across one probe tick.

Given the routing history, each tick is an ODE with a known, piecewise-constant input
(theory/discretisation.md): inflow of arc $(i,j)$ at routing $x^{k-m_{ij}-1}_{ij}$
(`xprev`) before $t_k + r_{ij}$ and $x^{k-m_{ij}}_{ij}$ (`xcur`) after it. An integrator's
`tick` returns the state at $t_{k+1}$, the workloads $N_j(t_k + h - r_{ij})$ that routers
will observe, and the tick's exact cumulative quantities (`TickResult`).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._arrivals import rate_integral
from .._shapes import like


class TickResult(eqx.Module):
    """One tick of one scenario.

    **Fields:**
    - `N`: `(n,)` workloads at $t_{k+1}$.
    - `observed`: `(n, n)` $N_j(t_k + h - r_{ij})$ (entry `[i, j]`).
    - `arrivals`, `departures`, `drops`: `(n,)` inflow into, service out of and flow
      dropped by each cell during the tick ($N_{k+1} = N_k + A - D - \\text{drops}$).
    - `workload_integral`: $\\int_{t_k}^{t_{k+1}} \\sum_j N_j$.
    - `status`: a `RESULTS` code (`success` or `solver_failed`).
    """

    N: Float[Array, " n"]
    observed: Float[Array, "n n"]
    arrivals: Float[Array, " n"]
    departures: Float[Array, " n"]
    workload_integral: Float[Array, ""]
    drops: Float[Array, " n"]
    status: Int[Array, ""]


class AbstractIntegrator(eqx.Module):
    """Advances the workloads across one tick (module docstring).

    `supports_buffers`: whether finite queues (`Scenario.buffer`, drops at a full cell) are
    implemented.
    """

    supports_buffers: ClassVar[bool] = True

    @abc.abstractmethod
    def tick(self, scn, setup, tk, N, xprev, xcur, c) -> TickResult:
        """One tick from $t_k$ = `tk`: `scn` (arrival profiles cut to the tick's window),
        `setup` (`TickSetup`), workloads `N`, the routings `xprev`/`xcur` in force on each
        arc before/after its switch, and the replica fractions `c` (`(n,)`)."""

    def prepared(self, dtype) -> AbstractIntegrator:
        """The integrator as the compiled loop holds it (e.g. tolerances as arrays, so that a
        sweep of them reuses one compilation)."""
        return self


def arc_integrals(scn, a, b):
    """$\\int_a^b \\lambda_i$ for arrays `a`, `b` whose axis -2 is the source cell $i$."""
    fn = jax.vmap(rate_integral, in_axes=(0, 0, -2, -2), out_axes=-2)
    return fn(scn.arrival_times, scn.arrival_rates, a, b)


def scaled_rate(service, c):
    """$\\mu_j^{(c)}(N) = c_j\\,\\mu_j(N/c_j)$: a cell running $c_j k_j$ of its $k_j$ replicas
    with the load spread evenly (theory/evaluation.md, *Replicas*)."""
    return lambda N: like(c, N) * service.rate(N / like(c, N))


def inflow_cumulative(scn, tk, s, tau, r, xprev, xcur):
    """Inflow into each arc accumulated from $t_k$ to $t_k + s$; `s` has shape `(S,)`.

    $\\int_{t_k}^{t_k+s}\\lambda_i(u-\\tau)x_{ij}(u-\\tau)du$ = `xprev` over $[0, \\min(s,r)]$
    plus `xcur` over $[r, \\max(s, r)]$ (local time). Returns `(S, n, n)`.
    """
    base = (tk - tau)[None]  # (1, n, n)
    s = s[:, None, None]
    r = r[None]
    lo1, hi1 = base, base + jnp.minimum(s, r)
    lo2, hi2 = base + r, base + jnp.maximum(s, r)
    lo1 = jnp.broadcast_to(lo1, hi1.shape)
    lo2 = jnp.broadcast_to(lo2, hi2.shape)
    return xprev[None] * arc_integrals(scn, lo1, hi1) + xcur[None] * arc_integrals(scn, lo2, hi2)


def cell_inflow_between(scn, tk, s0, s1, tau, r, xprev, xcur):
    """Inflow into cell $j$ over local times $[s0_{ij}, s1_{ij}]$ for every `(i, j)`.

    Entry `[i, j]` sums the arcs $(i', j)$ over sources $i'$; shape `(n, n)` (work $n^3$).
    """
    base = (tk - tau)[None]  # (1, i', j)
    r3 = r[None]
    a, b = s0[:, None, :], s1[:, None, :]  # (i, 1, j)
    xprev, xcur = xprev[None], xcur[None]

    def cum(s):
        lo1, hi1 = base, base + jnp.minimum(s, r3)
        lo2, hi2 = base + r3, base + jnp.maximum(s, r3)
        shape = jnp.broadcast_shapes(hi1.shape, hi2.shape)
        lo1, hi1, lo2, hi2 = (jnp.broadcast_to(v, shape) for v in (lo1, hi1, lo2, hi2))
        return xprev * arc_integrals(scn, lo1, hi1) + xcur * arc_integrals(scn, lo2, hi2)

    return jnp.sum(cum(b) - cum(a), axis=1)
