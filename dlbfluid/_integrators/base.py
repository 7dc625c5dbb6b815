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
from jaxtyping import Array, Float, Int

from .._scenario.arrivals import rate_integral
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
    def tick(self, scn, setup, tk, N, xprev, xcur, c, speed) -> TickResult:
        """One tick from $t_k$ = `tk`: `scn` (arrival profiles cut to the tick's window),
        `setup` (`TickSetup`), workloads `N`, the routings `xprev`/`xcur` in force on each
        arc before/after its switch, the replica fractions `c` and the speeds $1/s_j$ of
        the service schedules, `speed` (`(n,)` each): cell $j$ processes
        `scaled_rate(service, c, speed)`."""

    def for_batch(self, scn, tick: float) -> AbstractIntegrator:
        """The integrator for a batch whose longest tick is `tick` (host side, before
        compilation): e.g. a number of sub-steps chosen from the dynamics' time scale."""
        return self

    def prepared(self, dtype) -> AbstractIntegrator:
        """The integrator as the compiled loop holds it (e.g. tolerances as arrays, so that a
        sweep of them reuses one compilation)."""
        return self


def arc_integrals(scn, a, b):
    """$\\int_a^b \\lambda_i$ for arrays `a`, `b` whose axis -2 is the source cell $i$."""
    fn = jax.vmap(rate_integral, in_axes=(0, 0, -2, -2), out_axes=-2)
    return fn(scn.arrival_times, scn.arrival_rates, a, b)


def scaled_rate(service, c, speed=None):
    """$\\mu_j^{(c, v)}(N) = v_j c_j\\,\\mu_j(N/c_j)$: a cell running $c_j k_j$ of its $k_j$
    replicas with the load spread evenly (theory/evaluation.md, *Replicas*), at speed
    $v_j = 1/s_j$ of its service schedule (*Service schedules*; default 1)."""
    if speed is None:
        return lambda N: like(c, N) * service.rate(N / like(c, N))
    return lambda N: like(speed * c, N) * service.rate(N / like(c, N))
