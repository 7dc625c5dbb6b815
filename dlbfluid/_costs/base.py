"""The cost family: route costs $c_{ij}(N_j) = f_j(N_j) + g_{ij}$ (seed §3.2.3, §4).

A cost (`AbstractCost`) owns its destination part $f_j$, its arc part $g_{ij}$ and the
potential $p_j(z) = \\int_0^z f_j(\\mu_j^{-1}(s))\\,ds = \\int_0^{N} f_j(n)\\mu_j'(n)\\,dn$ whose sum
(plus $\\sum g_{ij}\\lambda_ix_{ij}$) the cost's equilibria minimise (theory/equilibria.md
§1). The routers evaluate costs from their believed service model (`Scenario.estimate`)
at the observed workloads (`route_costs`).

| cost | $f_j(N)$ | $g_{ij}$ | equilibrium |
|---|---|---|---|
| `rif` | $N/k_j$ | 0 | equal RIF per replica |
| `latency` | $\\ell_j(N)$ | $2\\tau_{ij}$ | Wardrop |
| `gradient` | $1/\\mu_j'(N)$ | $2\\tau_{ij}$ | social optimum |
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._registry import COSTS

# Gauss-Legendre rule of the generic potential: 64 nodes on [0, N].
_GL_X, _GL_W = np.polynomial.legendre.leggauss(64)


class AbstractCost(eqx.Module):
    """A cost family. Concrete costs are final, hold no arrays, and declare `name` (the
    word used by `solve_equilibrium`, `--cost`, JSON) and `short` (the policy suffix:
    `flow-SHORT`, `disc-SHORT`).

    `destination` is abstract; `arc` defaults to the round trip $2\\tau_{ij}$ and
    `potential` to a 64-point Gauss-Legendre quadrature of $f_j\\mu_j'$ on $[0, N_j]$
    (used only to report the objective $\\Psi$; the solvers need slopes alone).
    """

    name: ClassVar[str]
    short: ClassVar[str]

    @abc.abstractmethod
    def destination(self, scn, N):
        """$f_j(N_j)$ with the true service model `scn.service`; `N` has the cell axis last
        and may carry leading axes (e.g. routers)."""

    def arc(self, scn):
        """$g_{ij}$: the round trip $2\\tau_{ij}$ (0 on forbidden arcs)."""
        return 2.0 * scn.latency

    def slowed(self, f, s):
        """$f_j$ of a cell whose service times are multiplied by $s_j$ (a `service_schedule`),
        from its nominal value `f`: a cost measured in time is multiplied by $s$ (the
        default: $\\ell_j$ and $1/\\mu_j'$ both scale with the service time); a cost that
        counts requests overrides this."""
        return f * s

    def derivative(self, scn, N):
        """$f_j'(N_j)$ (forward-mode derivative of `destination`)."""
        return jax.jvp(lambda M: self.destination(scn, M), (N,), (jnp.ones_like(N),))[1]

    def potential(self, scn, z, N):
        """$p_j = \\int_0^{N_j} f_j(n)\\mu_j'(n)\\,dn$ at flows `z` and workloads `N`
        $= \\mu^{-1}(z)$ (`inf` where $N_j$ is)."""
        Nf = jnp.where(jnp.isfinite(N), N, 0.0)
        x = jnp.reshape(jnp.asarray(_GL_X), (-1,) + (1,) * Nf.ndim)
        cells = 0.5 * Nf[None] * (x + 1.0)  # (64, ..., n): the cell axis last
        vals = self.destination(scn, cells) * scn.service.rate_prime(cells)
        out = 0.5 * Nf * jnp.tensordot(jnp.asarray(_GL_W), vals, axes=(0, 0))
        return jnp.where(jnp.isfinite(N), out, jnp.inf)


def cost_from_name(cost) -> AbstractCost:
    """`"gradient"` -> `Gradient()`, ...; an `AbstractCost` is returned as it is."""
    if isinstance(cost, AbstractCost):
        return cost
    if isinstance(cost, str) and cost in COSTS:
        return COSTS.get(cost)
    raise ValueError(f"cost = {cost!r} is invalid: allowed costs are {list(COSTS.names())}")


def check_cost(cost) -> str:
    """The name of a registered cost (or `ValueError` naming the allowed ones)."""
    return cost_from_name(cost).name


def destination_cost(cost, scn, N):
    """$f_j(N_j)$ of the cost `cost` (a name or an `AbstractCost`)."""
    return cost_from_name(cost).destination(scn, N)


def arc_cost(cost, scn):
    """$g_{ij}$ of the cost `cost` (a name or an `AbstractCost`)."""
    return cost_from_name(cost).arc(scn)


def route_costs(cost, scn, N_observed, scale=None, slowdown=None):
    """$\\hat c_{ij} = \\hat f_j(N_j(t-\\tau_{ij})/c_{ij}) + g_{ij}$ from the `(n, n)` observed
    workloads, as the routers compute it.

    $\\hat f$ uses the routers' model `scn.estimate` (equal to the true `scn.service` unless
    an estimated model was given; seed §3.3). `scale` is the observed replica fraction
    $c_{ij} = k_j(t-\\tau_{ij})/k_j$ (default 1): a cell of $c k_j$ replicas behaves as the
    nominal cell at workload $N/c$, so all three costs, RIF included
    ($N/(c k_j) = (N/c)/k_j$), are the nominal ones at $N/c$ (theory/evaluation.md).
    `slowdown` is the observed service slowdown $s_{ij} = s_j(t-\\tau_{ij})$ (default 1):
    the latency and gradient costs are multiplied by it, RIF is not (`AbstractCost.slowed`).
    """
    c = cost_from_name(cost)
    believed = dataclasses.replace(scn, service=scn.estimate)
    N = N_observed if scale is None else N_observed / scale
    f = c.destination(believed, N)
    if slowdown is not None:
        f = c.slowed(f, slowdown)
    return f + c.arc(scn)


def short_name(cost) -> str:
    """The policy suffix of a cost (`"gradient"` -> `"grad"`)."""
    return cost_from_name(cost).short
