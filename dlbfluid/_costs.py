"""Route costs $c_{ij}(N_j) = f_j(N_j) + g_{ij}$ of the three DLB cost families (seed §3.2.3).

| cost       | $f_j(N)$              | $g_{ij}$        | equilibrium          |
|------------|-----------------------|-----------------|----------------------|
| `rif`      | $N/k_j$               | 0               | equal RIF/replica    |
| `latency`  | $\\ell_j(N)$           | $2\\tau_{ij}$    | Wardrop              |
| `gradient` | $1/\\mu_j'(N)$         | $2\\tau_{ij}$    | social optimum       |
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ._scenario import Scenario

COSTS = ("rif", "latency", "gradient")


def check_cost(cost: str) -> str:
    if cost not in COSTS:
        raise ValueError(f"cost = {cost!r} is invalid: allowed costs are {list(COSTS)}")
    return cost


def destination_cost(cost: str, scn: Scenario, N):
    """$f_j(N_j)$; `N` has the cell axis last and may carry leading axes (e.g. routers)."""
    if cost == "rif":
        return N / scn.replicas
    if cost == "latency":
        return scn.service.latency(N)
    if cost == "gradient":
        return scn.service.inv_rate_prime(N)
    raise ValueError(f"cost = {cost!r} is invalid: allowed costs are {list(COSTS)}")


def arc_cost(cost: str, scn: Scenario):
    """$g_{ij}$: 0 for RIF, the round trip $2\\tau_{ij}$ for latency and gradient costs."""
    if cost == "rif":
        return jnp.zeros_like(scn.latency)
    check_cost(cost)
    return 2.0 * scn.latency


def route_costs(cost: str, scn: Scenario, N_observed, scale=None):
    """$\\hat c_{ij} = \\hat f_j(N_j(t-\\tau_{ij})/c_{ij}) + g_{ij}$ from the `(n, n)` observed
    workloads, as the routers compute it.

    $\\hat f$ uses the routers' model `scn.estimate` (equal to the true `scn.service` unless
    an estimated model was given; seed §3.3). `scale` is the observed replica fraction
    $c_{ij} = k_j(t-\\tau_{ij})/k_j$ (default 1): a cell of $c k_j$ replicas behaves as the
    nominal cell at workload $N/c$, so all three costs, RIF included
    ($N/(c k_j) = (N/c)/k_j$), are the nominal ones at $N/c$ (theory/evaluation.md).
    """
    believed = dataclasses.replace(scn, service=scn.estimate)
    N = N_observed if scale is None else N_observed / scale
    return destination_cost(cost, believed, N) + arc_cost(cost, scn)
