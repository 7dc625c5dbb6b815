"""The range of the network cost over the RIF equilibria (theory/equilibria.md §5.1).

RIF's destination cost $f_j(N) = N/k_j$ has no arc part ($g_{ij} = 0$), so its equilibrium
workloads $N^*$ and arrival flows $z^* = \\mu(N^*)$ are unique (seed Lemma 1) but its routing
is not: every routing that sends each source's demand only to its cheapest allowed cells
and delivers $z^*$ is an equilibrium. The solver splits every source alike; `flow-rif`
reaches the same $N^*$ with mostly local traffic. The social cost
$C(x) = \\sum_j N^*_j + \\sum_{ij} 2\\tau_{ij}\\lambda_i x_{ij}$ is linear in the arc flows
$y_{ij} = \\lambda_i x_{ij}$, so its range over the equilibria is given by two transportation
linear programs

$$C_{min/max} = \\sum_j N^*_j + \\min/\\max_y \\sum_{(i,j)\\in\\mathcal T} 2\\tau_{ij}y_{ij}
\\quad\\text{s.t.}\\quad \\sum_j y_{ij} = \\lambda_i,\\quad \\sum_i y_{ij} = z^*_j,\\quad y \\ge 0,$$

over the tight arcs $\\mathcal T = \\{(i, j) \\text{ allowed}: \\lambda_i > 0,\\ f_j(N^*_j) =
\\min_{k} f_k(N^*_k)\\}$. They are solved by the interior-point method of `mnlb_weights`
(capacity $z^*$, utilisation cap 1: with $\\sum_j z^*_j = \\sum_i\\lambda_i$ every capacity
row is tight, i.e. an equality); the maximum as the minimum of $\\tau_{max} - \\tau_{ij}$.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._costs import cost_from_name
from .._policies.mnlb_weights import mnlb_weights
from .._results import RESULTS
from .._scenario import Scenario
from .api import EquilibriumSolution, _batch_bucket, solve_equilibrium

TIGHT_RTOL = 1e-7
"""An arc is tight when $f_j(N^*_j) - \\min_k f_k(N^*_k) \\le$ `TIGHT_RTOL`
$\\times\\max(1, |\\min_k f_k|)$ (the equilibrium holds the costs of used arcs equal to
$10^{-10}$)."""


class RIFLatencyRange(eqx.Module):
    """The social cost and mean latency over the RIF equilibria (batched: a leading axis).

    **Fields:**
    - `mean_latency_low`, `mean_latency_high`: $C_{min}/\\Lambda$, $C_{max}/\\Lambda$
      ($\\Lambda = \\sum_i\\lambda_i$; NaN without demand).
    - `social_cost_low`, `social_cost_high`: $C_{min}$, $C_{max}$.
    - `x_low`, `x_high`: `(n, n)` equilibrium routings attaining them.
    - `tight`: `(n, n)` the tight arcs $\\mathcal T$.
    - `status`: `RESULTS` code, the worse of the two linear programs.
    - `equilibrium`: the RIF `EquilibriumSolution` it was computed from.
    """

    mean_latency_low: Float[Array, "..."]
    mean_latency_high: Float[Array, "..."]
    social_cost_low: Float[Array, "..."]
    social_cost_high: Float[Array, "..."]
    x_low: Float[Array, "... n n"]
    x_high: Float[Array, "... n n"]
    tight: Bool[Array, "... n n"]
    status: Int[Array, "..."]
    equilibrium: EquilibriumSolution


def _arrival_rates(scenario: Scenario, time: float) -> np.ndarray:
    if len(scenario.batch_shape) == 0:
        return np.asarray(scenario.arrival_rate(time), dtype=float)
    return np.asarray(jax.vmap(lambda s: s.arrival_rate(time))(scenario), dtype=float)


def _transport(lam, costs, arcs, z, mask, tol):
    """Both programs as one batch of `mnlb_weights` (capacity $z^*$, cap 1), padded to the
    solver's batch buckets so that unbatched calls and small batches share one compiled
    program; returns the two routings and the two status arrays."""
    lead = lam.shape[:-1]
    n = lam.shape[-1]
    B = int(np.prod(lead, dtype=int))

    def flat(a, core):
        return np.broadcast_to(a, lead + core).reshape((B,) + core)

    def twice(a, core):
        return np.concatenate([flat(a, core)] * 2)

    Bb = _batch_bucket(2 * B, 1)
    parts = [
        twice(lam, (n,)),
        np.concatenate([flat(c, (n, n)) for c in costs]),
        twice(arcs, (n, n)),
        twice(z, (n,)),
        twice(mask, (n,)),
    ]
    lam_, cost_, arcs_, z_, mask_ = (
        np.concatenate([p, np.repeat(p[-1:], Bb - 2 * B, 0)]) for p in parts
    )
    x, info = mnlb_weights(lam_, cost_, arcs_, z_, utilisation_cap=1.0, cell_mask=mask_, tol=tol)
    x, status = np.asarray(x), np.asarray(info.status)
    out = [x[:B], x[B : 2 * B], status[:B], status[B : 2 * B]]
    return [a.reshape(lead + a.shape[1:]) for a in out]


def rif_latency_range(
    scenario: Scenario,
    *,
    equilibrium: EquilibriumSolution | None = None,
    time: float = 0.0,
    tol: float = 1e-10,
    **kwargs,
) -> RIFLatencyRange:
    """Least and greatest mean latency (network delays included) over the RIF equilibria.

    $C_{min/max} = \\sum_j N^*_j + \\min/\\max\\{\\sum 2\\tau_{ij}y_{ij}: y \\ge 0 \\text{ on the
    tight arcs},\\ \\sum_j y_{ij} = \\lambda_i,\\ \\sum_i y_{ij} = z^*_j\\}$ (module docstring;
    theory/equilibria.md §5.1), with $N^*, z^*$ from `solve_equilibrium(scenario, "rif")`.
    The solver's own routing lies in this set, so
    `mean_latency_low <= equilibrium.mean_latency <= mean_latency_high`.

    **Arguments:**
    - `scenario`: a `Scenario` or a batch (`stack_scenarios`).
    - `equilibrium`: a precomputed RIF `EquilibriumSolution` of `scenario` at `time`.
    - `time`: arrival rates $\\lambda_i(\\texttt{time})$.
    - `tol`: interior-point tolerance of the two linear programs (`mnlb_weights`), the
      equilibrium's own certification level. (1e-12 is not reliably attainable: on a
      degenerate instance, a busy cell whose arcs in are not tight, the method stalls at
      an error of about 1e-12 and ends `not_converged` or `success` depending on the last
      bits of $z^*$; tests/test_rif_range.py::test_batch_matches_linprog_and_unbatched.)
    - `**kwargs`: options of `solve_equilibrium` when `equilibrium` is not given.

    **Returns:** a `RIFLatencyRange`.

    **Raises:** `ValueError` if `equilibrium` is not a RIF equilibrium.
    """
    cost = cost_from_name("rif")
    if equilibrium is None:
        equilibrium = solve_equilibrium(scenario, cost, time=time, **kwargs)
    elif equilibrium.cost != cost.name:
        raise ValueError(
            f"equilibrium.cost = {equilibrium.cost!r} is invalid: expected a 'rif' equilibrium"
        )
    sol = equilibrium
    lam = _arrival_rates(scenario, time)
    mask = np.asarray(scenario.cell_mask)
    allowed = np.asarray(scenario.allowed) & mask[..., :, None] & mask[..., None, :]
    tau = np.where(allowed, np.asarray(scenario.latency, dtype=float), 0.0)
    N = np.asarray(sol.N, dtype=float)
    z = np.where(mask, np.maximum(np.asarray(sol.z, dtype=float), 0.0), 0.0)
    x = np.asarray(sol.x, dtype=float)
    lam = np.where(mask, lam, 0.0)

    f = np.asarray(cost.destination(scenario, jnp.asarray(N)), dtype=float)
    c = np.where(allowed, f[..., None, :], np.inf)
    cmin = np.min(c, axis=-1, keepdims=True)
    cmin = np.where(np.isfinite(cmin), cmin, 0.0)
    tight = allowed & (lam[..., :, None] > 0)
    tight &= (c - cmin <= TIGHT_RTOL * np.maximum(1.0, np.abs(cmin))) | (x > 0)

    tmax = np.max(np.where(tight, tau, 0.0), axis=(-2, -1), keepdims=True)
    x_lo, x_hi, st_lo, st_hi = _transport(
        lam, [tau, np.where(tight, tmax - tau, 0.0)], tight, z, mask, tol
    )

    work = np.sum(np.where(mask, N, 0.0), axis=-1)
    Lam = np.sum(lam, axis=-1)

    def social(xr):
        return work + np.sum(2.0 * tau * lam[..., :, None] * np.asarray(xr), axis=(-2, -1))

    lo, hi = social(x_lo), social(x_hi)
    safe = np.where(Lam > 0, Lam, 1.0)
    status = np.maximum(st_lo, st_hi)
    status = np.where(np.asarray(sol.status) != RESULTS.success, np.asarray(sol.status), status)
    return RIFLatencyRange(
        mean_latency_low=jnp.asarray(np.where(Lam > 0, lo / safe, np.nan)),
        mean_latency_high=jnp.asarray(np.where(Lam > 0, hi / safe, np.nan)),
        social_cost_low=jnp.asarray(lo),
        social_cost_high=jnp.asarray(hi),
        x_low=jnp.asarray(x_lo),
        x_high=jnp.asarray(x_hi),
        tight=jnp.asarray(tight),
        status=jnp.asarray(status, jnp.int32),
        equilibrium=sol,
    )
