"""Sensitivities of an equilibrium by implicit differentiation of its optimality system.

At an equilibrium with support $T$ (the arcs that carry flow), the state
$u = (y, z, \\nu, N)$ solves the square system $G(u, \\theta) = 0$:

* $f_j(N_j) + g_{ij} - \\nu_i = 0$ on the arcs of $T$, $y_{ij} = 0$ off $T$;
* $\\sum_j y_{ij} = \\lambda_i$ (sources with an allowed arc; $\\nu_i = 0$ otherwise);
* $\\sum_i y_{ij} = z_j$;
* $h_j(N_j, z_j) = N_j(\\bar\\mu_j - z_j)/\\bar\\mu_j - z_j r_j(N_j) = 0$ (the flow balance
  $\\mu_j(N_j) = z_j$ written as in `_Problem.cells`);

with parameters $\\theta = (\\bar\\mu, \\lambda, \\tau)$. Holding $T$ fixed (the hint of the
issue: degenerate arcs, with no flow and zero reduced cost, stay out), the implicit
function theorem gives $du/d\\theta = -(\\partial_u G)^{-1}\\partial_\\theta G$
(theory/equilibria.md §6). $y$ is not unique when $T$ contains a cycle, so $T$ is reduced
to a spanning forest first (Kruskal by decreasing flow); $z$, $N$ and $\\nu$ and the mean
latency do not depend on that choice. A source without demand keeps its cheapest arc in
$T$ with zero flow, so that $d/d\\lambda_i$ is the one-sided derivative of adding demand.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._costs import AbstractCost, cost_from_name
from .._scenario import Scenario
from . import solve_equilibrium


def _spanning_forest(flow: np.ndarray, support: np.ndarray) -> np.ndarray:
    """Largest-flow spanning forest of the bipartite support graph (sources, cells)."""
    n = flow.shape[0]
    parent = list(range(2 * n))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    keep = np.zeros_like(support)
    arcs = [(flow[i, j], i, j) for i in range(n) for j in range(n) if support[i, j]]
    for _, i, j in sorted(arcs, key=lambda t: -t[0]):
        a, b = find(i), find(n + j)
        if a != b:
            parent[a] = b
            keep[i, j] = True
    return keep


def _residual(u, theta, scn: Scenario, T, has_arc, cost: AbstractCost):
    """$G(u, \\theta)$ of the module docstring, each block scaled to order one."""
    y, z, nu, N = u
    cap, lam, tau = theta
    svc = eqx.tree_at(lambda s: s.params["capacity"], scn.service, cap)
    s2 = dataclasses.replace(scn, service=svc, latency=tau)
    F = cost.destination(s2, jnp.maximum(N, 1e-300))
    G1 = jnp.where(T, F[None, :] + cost.arc(s2) - nu[:, None], y)
    G2 = jnp.where(has_arc, jnp.sum(y, axis=1) - lam, nu)
    G3 = jnp.sum(y, axis=0) - z
    G4 = svc.balance(N, z)[0]
    return G1, G2, G3, G4


class _Parts(eqx.Module):
    scn: Scenario
    T: jax.Array
    has_arc: jax.Array
    cost: AbstractCost = eqx.field(static=True)


@eqx.filter_jit
def _jacobians(u, theta, parts: _Parts):
    def flat_G(uf, th):
        G = _residual(unflat_u(uf), th, parts.scn, parts.T, parts.has_arc, parts.cost)
        return jnp.concatenate([a.ravel() for a in G])

    n = u[3].shape[0]

    def unflat_u(uf):
        y = uf[: n * n].reshape(n, n)
        return y, uf[n * n : n * n + n], uf[n * n + n : n * n + 2 * n], uf[n * n + 2 * n :]

    uf = jnp.concatenate([a.ravel() for a in u])
    Ju = jax.jacfwd(flat_G, 0)(uf, theta)
    Jt = jax.jacfwd(flat_G, 1)(uf, theta)
    # Row equilibration before the dense solve (the blocks have different units).
    scale = 1.0 / jnp.maximum(jnp.max(jnp.abs(Ju), axis=1), 1e-300)
    Ju = Ju * scale[:, None]
    Jt = jax.tree_util.tree_map(lambda a: a * scale.reshape((-1,) + (1,) * (a.ndim - 1)), Jt)
    lu = jax.scipy.linalg.lu_factor(Ju)

    def solve(b):
        shape = b.shape
        out = jax.scipy.linalg.lu_solve(lu, -b.reshape(b.shape[0], -1))
        return out.reshape(shape)

    return jax.tree_util.tree_map(solve, Jt)


def equilibrium_sensitivities(
    scenario: Scenario, cost: str | AbstractCost = "gradient", *, time: float = 0.0, **solve_kwargs
) -> dict:
    """Derivatives of the equilibrium mean latency and workloads with respect to the
    capacities $\\bar\\mu$, arrival rates $\\lambda$ and one-way latencies $\\tau$.

    The mean latency is $L = (\\sum_j N_j + \\sum_{ij}2\\tau_{ij}y_{ij})/\\Lambda$ at the
    equilibrium of `cost`; for `gradient` it is the optimal (minimum) mean latency and
    the envelope theorem gives $\\partial(\\Lambda L)/\\partial\\lambda_i = \\nu_i$ and
    $\\partial(\\Lambda L)/\\partial\\tau_{ij} = 2y_{ij}$ (theory/equilibria.md §6).
    Derivatives are exact (implicit differentiation on the support, held fixed), not
    finite differences.

    **Arguments:**
    - `scenario`: one unbatched `Scenario`.
    - `cost`: `"gradient"` (default), `"latency"` or `"rif"`.
    - `time`: arrival rates $\\lambda_i(\\texttt{time})$; derivatives are with respect to
      those values.
    - `solve_kwargs`: options of `solve_equilibrium` (`tol`, `max_iters`).

    **Returns:** a dict of numpy arrays: `mean_latency`, `N`, `z`, `multipliers`,
    `d_mean_latency_d_capacity` `(n,)`, `d_mean_latency_d_arrival_rate` `(n,)`,
    `d_mean_latency_d_latency` `(n, n)`, `dN_d_capacity` `(n, n)` ($\\partial N_j /
    \\partial\\bar\\mu_k$ at `[j, k]`), `dN_d_arrival_rate` `(n, n)`, `dN_d_latency`
    `(n, n, n)` ($\\partial N_j/\\partial\\tau_{ik}$ at `[j, i, k]`), and `solution` (the
    `EquilibriumSolution`). Entries for forbidden arcs are zero.

    **Raises:** `ValueError` for a batched scenario or an unknown cost; the errors of
    `solve_equilibrium`.
    """
    family = cost_from_name(cost)
    if len(scenario.batch_shape) != 0:
        raise ValueError(
            "equilibrium_sensitivities needs one unbatched scenario; loop over "
            "the batch (or index it) instead"
        )
    sol = solve_equilibrium(scenario, family, time=time, **solve_kwargs)
    scn = scenario.strip()
    n = scn.n_cells
    lam = np.asarray(scn.arrival_rate(time))
    mask = np.asarray(scn.cell_mask)
    allowed = np.asarray(scn.allowed) & mask[:, None] & mask[None, :]
    x = np.asarray(sol.x)
    y = lam[:, None] * x
    src = mask & (lam > 0)
    support = allowed & (x > 0) & src[:, None]
    has_arc = allowed.any(axis=1)
    for i in np.nonzero(has_arc & ~src)[0]:
        support[i, int(np.argmax(x[i]))] = True
    T = _spanning_forest(np.where(support, y + 1e-300, 0.0), support)
    y = np.where(T, y, 0.0)
    # Multipliers: the cost of the support arcs (equal on each source at equilibrium).
    F = np.asarray(family.destination(scn, jnp.asarray(sol.N)))
    g = np.asarray(family.arc(scn))
    c = F[None, :] + g
    nu = np.where(has_arc, np.sum(np.where(T, c, 0.0), axis=1) / np.maximum(T.sum(1), 1), 0.0)
    u = (jnp.asarray(y), jnp.asarray(sol.z), jnp.asarray(nu), jnp.asarray(sol.N))
    tau = np.asarray(scn.latency)
    theta = (scn.service.capacity, jnp.asarray(lam), jnp.asarray(tau))
    parts = _Parts(scn=scn, T=jnp.asarray(T), has_arc=jnp.asarray(has_arc), cost=family)
    d_cap, d_lam, d_tau = (np.asarray(a) for a in _jacobians(u, theta, parts))
    # Rows of the flattened state: y (n*n), z (n), nu (n), N (n).
    sl_y, sl_N = slice(0, n * n), slice(n * n + 2 * n, n * n + 3 * n)
    Lam = lam.sum()
    Nst = np.asarray(sol.N)
    ml = (Nst.sum() + np.sum(2.0 * tau * y)) / Lam

    def d_ml(dstate, dtau_direct=None, dlam_direct=None):
        # dstate: (n*n + 3n, *p)
        dy = dstate[sl_y].reshape((n, n) + dstate.shape[1:])
        dN = dstate[sl_N]
        out = dN.sum(axis=0) + np.tensordot(2.0 * tau, dy, axes=([0, 1], [0, 1]))
        if dtau_direct is not None:
            out = out + dtau_direct
        if dlam_direct is not None:
            out = out + dlam_direct
        return out / Lam

    dml_cap = d_ml(d_cap)
    dml_lam = d_ml(d_lam, dlam_direct=-ml * np.ones(n))
    dml_tau = d_ml(d_tau, dtau_direct=2.0 * y)
    dml_tau = np.where(allowed, dml_tau, 0.0)
    dN_tau = np.where(allowed[None], d_tau[sl_N], 0.0)
    return {
        "mean_latency": float(ml),
        "N": Nst,
        "z": np.asarray(sol.z),
        "multipliers": nu,
        "d_mean_latency_d_capacity": dml_cap,
        "d_mean_latency_d_arrival_rate": dml_lam,
        "d_mean_latency_d_latency": dml_tau,
        "dN_d_capacity": d_cap[sl_N],
        "dN_d_arrival_rate": d_lam[sl_N],
        "dN_d_latency": dN_tau,
        "solution": sol,
    }
