"""Independent float64 solve of program (12) with cvxpy + Clarabel, for all-M/M/1 networks.

The potentials are the closed forms of theory/equilibria.md §1.2. Used by the equilibrium tests
(tight tolerances) and by benchmarks/bench_equilibrium.py (Clarabel's defaults, as a user
would run it). No dlbfluid import.
"""

from __future__ import annotations

import warnings

import numpy as np


def cvxpy_solve(d: dict, cost: str, *, tight: bool = True):
    """Returns `(z, N, objective)` of the `cost` equilibrium of scenario dict `d`."""
    import cvxpy as cp

    n = len(d["cells"])
    lam = np.array([c["arrival_rate"] for c in d["cells"]])
    cap = np.array([c["service"]["capacity"] for c in d["cells"]])
    k = np.array([c["replicas"] for c in d["cells"]], dtype=float)
    allowed = np.array([[v is not None for v in row] for row in d["latency"]])
    tau = np.array([[0.0 if v is None else v for v in row] for row in d["latency"]])
    X = cp.Variable((n, n), nonneg=True)
    cons = [cp.sum(X, axis=1) == 1]
    if (~allowed).any():
        cons.append(cp.multiply(X, (~allowed).astype(float)) == 0)
    z = lam @ X
    if cost == "gradient":  # p = z/(c - z) = c/(c - z) - 1
        p = cp.sum(cp.multiply(cap, cp.inv_pos(cap - z))) - n
    elif cost == "latency":  # p = -log(1 - z/c)
        p = -cp.sum(cp.log(1 - cp.multiply(z, 1 / cap)))
    else:  # p = (-z - c log(1 - z/c)) / k
        p = cp.sum(cp.multiply(1 / k, -z - cp.multiply(cap, cp.log(1 - cp.multiply(z, 1 / cap)))))
    g = np.zeros_like(tau) if cost == "rif" else 2 * tau
    prob = cp.Problem(cp.Minimize(p + cp.sum(cp.multiply(g * lam[:, None], X))), cons)
    opts = (
        dict(tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12, tol_ktratio=1e-12)
        if tight
        else {}
    )
    with warnings.catch_warnings():  # Clarabel flags its tightest settings "inaccurate"
        warnings.simplefilter("ignore")
        prob.solve(solver=cp.CLARABEL, **opts)
    zv = lam @ X.value
    return zv, zv / (cap - zv), prob.value
