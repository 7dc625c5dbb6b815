"""Equilibria of the DLB fluid model as one batched convex program (seed §4, App. C.2).

For a cost family $c_{ij}(N_j) = f_j(N_j) + g_{ij}$ (`rif`, `latency`, `gradient`, or any
registered `AbstractCost`), the equilibrium routing minimises the potential

$$\\Psi(x) = \\sum_j p_j(z_j) + \\sum_{(i,j)} g_{ij}\\lambda_i x_{ij}, \\qquad
z_j = \\sum_i \\lambda_i x_{ij}, \\qquad p_j(z) = \\int_0^z f_j(\\mu_j^{-1}(s))\\,ds$$

over the product of simplices restricted to allowed arcs, with $z_j < \\bar\\mu_j$
(theory/equilibria.md §1). `EquilibriumSolver` works with the arc flows
$y_{ij} = \\lambda_i x_{ij}$ (theory/equilibria.md §3): an infeasible-start interior-point
method (`InteriorPoint`) brings the per-source duality gap below `1e-10`, then an
active-set Newton polish (`ActiveSetPolish`) solves the equality optimality system on the
identified support to rounding level. Every scenario of a batch runs the same array
program (vmap); padded cells carry no arcs and no arrivals. `_certify` turns the result
into a routing, workloads and a KKT certificate (theory/equilibria.md §2).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._costs import AbstractCost, cost_from_name
from .._errors import OverloadError
from .._precision import require_x64
from .._results import RESULTS, raise_for_status, status_names, view
from .._runtime import exported
from .._runtime.devices import compiler_options, shard_batch, uses_float32
from .._scenario import Scenario, check_capacity, pad_scenario
from .._service import BUILTIN_LAWS
from .solver import EquilibriumSolver, _solve_batch, _solve_batch_impl

EQ_STATUS = view("success", "not_converged", "nonfinite")
"""The `RESULTS` codes an equilibrium solve can end with."""


class EquilibriumError(RuntimeError):
    """A scenario of a `throw=True` equilibrium solve did not converge."""


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
        """Per-scenario status names (`RESULTS`)."""
        return status_names(self.status)

    def raise_for_status(self) -> None:
        """Raise `EquilibriumError` if any scenario did not end with `success`."""
        kkt = np.atleast_1d(np.asarray(self.kkt_residual))
        raise_for_status(
            self.status,
            EquilibriumError,
            f"{self.cost} equilibrium",
            lambda bad: f", KKT residuals {kkt[bad][:10].tolist()}",
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
            "status": RESULTS.name(int(self.status)),
            "cells": list(self.cell_names),
        }


def _bucket(n: int) -> int:
    """Cell count an unbatched scenario is padded to (4, 8, 16, ...): scenarios of nearby
    sizes share one compiled solver."""
    b = 4
    while b < n:
        b *= 2
    return b


def _widen(scn: Scenario) -> Scenario:
    """The same cells with service tables that evaluate (at least) both built-in laws, so
    that M/M/1-only, softplus-only and mixed scenarios share one compiled solver (a law a
    cell does not follow is only selected away: the results are the same)."""
    return dataclasses.replace(
        scn,
        service=scn.service.with_laws(BUILTIN_LAWS),
        estimate=scn.estimate.with_laws(BUILTIN_LAWS),
    )


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
    for b in (int(v) for v in np.nonzero(~quick)[0]):
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
    cost: str | AbstractCost,
    *,
    tol: float = 1e-10,
    max_iters: int = 200,
    time: float = 0.0,
    throw: bool | None = None,
    check: bool = True,
    solver: EquilibriumSolver = EquilibriumSolver(),
) -> EquilibriumSolution:
    """Equilibrium of the cost family `cost` as the minimiser of the convex program (12).

    $\\min_{x \\in \\mathcal X} \\Psi(x) = \\sum_j p_j(z_j) + \\sum_{(i,j)} g_{ij}\\lambda_ix_{ij}$,
    $z_j = \\sum_i\\lambda_ix_{ij} < \\bar\\mu_j$, $p_j(z) = \\int_0^z f_j(\\mu_j^{-1}(s))ds$
    (seed §4, App. C.2; theory/equilibria.md). `rif` gives equal RIF per replica,
    `latency` the Wardrop equilibrium, `gradient` the social optimum (minimum mean
    end-to-end latency).

    **Arguments:**
    - `scenario`: a `Scenario`, or a batch from `stack_scenarios` (leading axis `B`).
    - `cost`: `"rif"`, `"latency"`, `"gradient"`, any registered cost name, or an
      `AbstractCost`.
    - `tol`: KKT residual below which a scenario reports `success`.
    - `max_iters`: interior-point iteration cap (a polish of at most
      `ActiveSetPolish.iters` Newton steps follows).
    - `time`: arrival rates are $\\lambda_i(\\texttt{time})$ of each profile.
    - `throw`: raise `EquilibriumError` on a failed scenario; default True unbatched,
      False for a batch (failures are then reported in `status`).
    - `check`: test Assumption 2 first (set False only for inputs known to be feasible).
    - `solver`: an `EquilibriumSolver` (its stages' tunables are its fields).

    **Returns:** an `EquilibriumSolution`, batched iff `scenario` is.

    **Raises:** `ValueError` for an unknown cost or bad options; `OverloadError` naming
    the overloaded cells and sources when no routing serves the demand within capacity;
    `X64Error` while JAX's x64 mode is off (the solver computes in float64).
    """
    require_x64("solve_equilibrium")
    cost = cost_from_name(cost)
    if not isinstance(solver, EquilibriumSolver):
        raise ValueError(f"solver = {solver!r} is invalid: expected an EquilibriumSolver")
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
        # (a batch keeps its cell count: padding it scenario by scenario on the host cost
        # 2 ms per scenario, 20 s for 10,000)
        scn = scenario.strip()
    else:
        scn = pad_scenario(scenario, _bucket(n)).strip()
        scn = jax.tree_util.tree_map(lambda a: a[None], scn)
    scn = _widen(scn)
    B = scn.batch_shape[0]
    # Pad the batch to a bucket size that is a multiple of the device count, so that
    # nearby batch sizes (and every unbatched call) share one compiled solver.
    ndev = jax.local_device_count()
    Bb = _batch_bucket(B, ndev)
    scn = _prepare(scn, jnp.asarray(time, jnp.float64), Bb)
    scn = shard_batch(scn)
    lam = scn.arrival_rates[..., 0]
    out = exported.call(
        "equilibrium",
        functools.partial(_solve_batch, cost=cost, solver=solver),
        (scn, lam, jnp.asarray(tol, jnp.float64), jnp.asarray(max_iters, jnp.int32)),
        (cost, solver),
        trace=functools.partial(_solve_batch_impl, cost=cost, solver=solver),
        compiler_options=compiler_options(uses_float32(scn), certified=True),
    )
    out, mask = _take((out, scn.cell_mask), B)
    sol = EquilibriumSolution(
        cell_mask=mask,
        cost=cost.name,
        cell_names=tuple(scenario.cell_names) if not batched else (),
        **out,
    )
    if not batched:
        sol = jax.tree_util.tree_map(lambda a: a[0], sol)
    if sol.cell_mask.shape[-1] > n:
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
        (
            sol.x[..., :n, :n],
            sol.z[..., :n],
            sol.N[..., :n],
            sol.multipliers[..., :n],
            sol.cell_mask[..., :n],
        ),
    )
