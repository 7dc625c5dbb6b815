"""The price of anarchy of the Wardrop (latency) and RIF equilibria against the social
optimum (theory/equilibria.md §5), with the range over RIF's equilibria (§5.1). Above both
`api` (the solver's verb) and `rif_range`, which it combines."""

from __future__ import annotations

import jax.numpy as jnp

from .._scenario import Scenario
from .api import solve_equilibrium
from .rif_range import rif_latency_range


def price_of_anarchy(scenario: Scenario, **kwargs) -> dict:
    """Price of anarchy of the Wardrop (latency) and RIF equilibria, per scenario.

    $\\mathrm{PoA}_c = C(x^c)/C(x^{grad})$ with the social cost
    $C(x) = \\sum_jN_j + \\sum_{ij}2\\tau_{ij}\\lambda_ix_{ij}$ (theory/equilibria.md §5).
    Without demand (every $\\lambda_i = 0$ at `time`) every routing costs $C = 0$ and the
    ratio is undefined: it is NaN for that scenario (`dlbfluid equilibrium` prints
    "undefined" and writes null).

    **Arguments:** `scenario` (unbatched or batched) and the keyword options of
    `solve_equilibrium`.

    RIF's routing is not unique (its workloads are), so `"rif"` is the ratio of the
    routing the solver returns; `"rif_price_of_anarchy_range"` is the range over every RIF
    equilibrium (`rif_latency_range`, theory/equilibria.md §5.1).

    **Returns:** `{"latency": ratio, "rif": ratio, "rif_mean_latency_range": (..., 2) least
    and greatest mean latency over the RIF equilibria, "rif_price_of_anarchy_range":
    (..., 2), "rif_range": RIFLatencyRange, "equilibria": {cost: EquilibriumSolution}}` (a
    ratio is NaN where the social optimum's cost is 0, a latency where there is no demand).
    """
    sols = {c: solve_equilibrium(scenario, c, **kwargs) for c in ("gradient", "latency", "rif")}
    opt = jnp.asarray(sols["gradient"].social_cost)
    defined = opt > 0
    safe = jnp.where(defined, opt, 1.0)

    def ratio(c):
        return jnp.where(defined, jnp.asarray(sols[c].social_cost) / safe, jnp.nan)

    rng = rif_latency_range(scenario, equilibrium=sols["rif"], time=kwargs.get("time", 0.0))
    return {
        "latency": ratio("latency"),
        "rif": ratio("rif"),
        "rif_mean_latency_range": jnp.stack([rng.mean_latency_low, rng.mean_latency_high], -1),
        "rif_price_of_anarchy_range": jnp.stack(
            [
                jnp.where(defined, rng.social_cost_low / safe, jnp.nan),
                jnp.where(defined, rng.social_cost_high / safe, jnp.nan),
            ],
            -1,
        ),
        "rif_range": rng,
        "equilibria": sols,
    }
