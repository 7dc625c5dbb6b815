"""The equilibrium solver's loop state (one scenario; vmapped over a batch)."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int


class Iterate(eqx.Module):
    """A point of the interior-point method.

    **Fields:** `y` `(n, n)` arc flows; `s` `(n, n)` duals of $y \\ge 0$; `nu` `(n,)`
    multipliers of $\\sum_j y_{ij} = \\lambda_i$; `N` `(n,)` workloads $\\mu^{-1}(z)$; `w` `(n, n)`
    barrier weights $w_{ij} = \\lambda_i\\bar c_i$.
    """

    y: Float[Array, "n n"]
    s: Float[Array, "n n"]
    nu: Float[Array, " n"]
    N: Float[Array, " n"]
    w: Float[Array, "n n"]


class SolverState(eqx.Module):
    """State of `EquilibriumSolver` (theory/equilibria.md §3).

    **Attributes**, by role:
    - the current point: `point` (an `Iterate`) and `tau`, the barrier weight;
    - progress: `phase` (0 interior point, 1 polish), `it` (interior-point iterations),
      `pol` (polish passes of the current polish), `ptot` (polish passes in all),
      `capped` (stage 1 stopped at `max_iters`: the polish only scores its point);
    - the polish: `act` `(n, n)`, its support; `banned`, the arcs it dropped on its last
      pass (they may not rejoin on the next); `best_y`, `best_N`, `best_m`, the best point
      seen and its scaled residual (what the solver returns);
    - flags: `fresh` (first pass: dual estimates from the start), `converged` (the
      interior point reached its gap), `retry` (the early hand-over has not failed yet);
    - the resume point: `keep`, `keep_tau`, where the interior point ended its first
      hand-over (a failed early polish resumes stage 1 from there);
    - stall detection: `score`, the interior point's best convergence score in this round
      (1 = converged), and `stall`, passes since it last halved.
    """

    point: Iterate
    tau: Float[Array, ""]
    phase: Int[Array, ""]
    it: Int[Array, ""]
    pol: Int[Array, ""]
    ptot: Int[Array, ""]
    capped: Bool[Array, ""]
    act: Bool[Array, "n n"]
    banned: Bool[Array, "n n"]
    best_y: Float[Array, "n n"]
    best_N: Float[Array, " n"]
    best_m: Float[Array, ""]
    fresh: Bool[Array, ""]
    converged: Bool[Array, ""]
    retry: Bool[Array, ""]
    keep: Iterate
    keep_tau: Float[Array, ""]
    score: Float[Array, ""]
    stall: Int[Array, ""]
