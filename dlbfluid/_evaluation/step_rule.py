"""The paper's step-size rule (seed App. B; theory/evaluation.md, *Step sizes*): router $i$
of a flow policy takes $\\eta_i = \\kappa_c/\\bar\\tau_i$, with $\\bar\\tau_i$ its mean delay
to the cells it may route to. `experiment` and `verify` both use it
(`--step-rule paper`); numpy only, below both.
"""

from __future__ import annotations

import numpy as np

from .config import STEP_RULE_KAPPA


def mean_remote_delay(scenario) -> np.ndarray:
    """$\\bar\\tau_i$, `(n,)`: the mean one-way delay from router $i$ to the other cells it
    may route to; a router with none takes the mean over the scenario's remote arcs (its
    step size moves nothing: its simplex is one point), and a scenario without remote arcs
    takes 1 s."""
    tau = np.asarray(scenario.latency, float)
    real = np.asarray(scenario.cell_mask, bool)
    remote = np.asarray(scenario.allowed, bool) & ~np.eye(tau.shape[0], dtype=bool)
    remote &= real[:, None] & real[None, :]
    count = remote.sum(axis=1)
    total = np.where(remote, tau, 0.0).sum(axis=1)
    overall = total.sum() / count.sum() if count.sum() else 1.0
    return np.where(count > 0, total / np.maximum(count, 1), overall)


def paper_step_sizes(scenarios, cost: str, n: int | None = None) -> np.ndarray:
    """The paper's step-size rule, `(len(scenarios), n)`: router $i$ of a flow policy with
    cost family `cost` takes $\\eta_i = \\kappa_c/\\bar\\tau_i$ (`mean_remote_delay`),
    $\\kappa_c$ = `STEP_RULE_KAPPA[cost]`; padded cells 0. Only delays enter: the routers
    measure them, so the rule needs no model of the cells."""
    if cost not in STEP_RULE_KAPPA:
        raise ValueError(
            f"step_rule = 'paper' is invalid for cost {cost!r}: kappa is calibrated for "
            f"{list(STEP_RULE_KAPPA)}; use step_rule = 'oracle' (--step-rule oracle)"
        )
    kappa = STEP_RULE_KAPPA[cost]
    rows = []
    for s in scenarios:
        real = np.asarray(s.cell_mask, bool)
        eta = np.where(real, kappa / mean_remote_delay(s), 0.0)
        rows.append(padded(eta, eta.shape[0] if n is None else n))
    return np.stack(rows)


def padded(a: np.ndarray, n: int) -> np.ndarray:
    """`a` followed by zeros to length `n` (padded cells)."""
    return np.concatenate([a, np.zeros(n - a.shape[0], a.dtype)])
