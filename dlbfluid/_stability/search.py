"""What every crossing search shares (theory/stability.md §3.5): the result record, the
progress of the tests, the initial guess from the symmetric scaling and the bracket.
"""

from __future__ import annotations

import math
import sys

import equinox as eqx
import numpy as np

from .._runtime.progress import Progress
from .linearisation import Linearisation
from .symmetric import symmetric_critical_gain


class StabilityResult(eqx.Module):
    """The outcome of `critical_step_size`.

    **Fields:**
    - `critical_step_size`: $\\eta^*$ (`inf`: stable for every step size; `0`: unstable even
      for vanishing steps).
    - `method`: `"symmetric"`, `"pseudospectral"` or `"nyquist"`.
    - `rightmost_root`: the rightmost characteristic root at $\\eta^*$ ($\\approx i\\omega_c$;
      `nan` when there is no crossing).
    - `crossing_frequency`: $\\omega_c$ (rad/s); `period`: $2\\pi/\\omega_c$ (s).
    - `nodes`: Chebyshev nodes $M$ used (0 for the closed form and for `"nyquist"`).
    - `N`, `x`: the equilibrium; `policy`, `tau_scale`.
    - `linearisation`: the `Linearisation` it was computed from.
    """

    critical_step_size: float
    method: str
    rightmost_root: complex
    crossing_frequency: float
    period: float
    nodes: int
    N: np.ndarray
    x: np.ndarray
    policy: str
    tau_scale: float
    linearisation: Linearisation

    def summary(self) -> dict:
        """The JSON record of `dlbfluid stability --json`."""
        lin = self.linearisation
        s = self.rightmost_root
        return {
            "policy": self.policy,
            "critical_step_size": self.critical_step_size,
            "stable_for_every_step_size": bool(self.critical_step_size == math.inf),
            "method": self.method,
            "nodes": self.nodes,
            "tau_scale": self.tau_scale,
            "rightmost_root": {"real": s.real, "imag": s.imag},
            "crossing_frequency": self.crossing_frequency,
            "period": self.period,
            "equilibrium": {"N": np.asarray(self.N).tolist(), "x": np.asarray(self.x).tolist()},
            "delays": np.asarray(lin.delays).tolist(),
            "state_dimension": lin.dim,
            "routing_sources": list(lin.sources),
            "supports": [list(S) for S in lin.supports],
            "neutral_directions": lin.n_neutral,
            "degenerate_arcs": [list(a) for a in lin.degenerate_arcs],
        }


class Steps:
    """Progress of the crossing search on stderr (`dlbfluid._runtime.progress.Progress`): one unit
    per stability test; the total is re-estimated once the bracket is known."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.bar = Progress(label, total, enabled=enabled, unit="tests") if enabled else None
        self.done = 0

    def __call__(self, note: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.total = max(self.bar.total, self.done + 1)
            self.bar.update(self.done, note)

    def expect(self, more: int) -> None:
        if self.bar is not None:
            self.bar.total = self.done + max(int(more), 1)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.total = self.done
            self.bar.update(self.done, "done")


def initial_guess(lin: Linearisation) -> float:
    """$\\eta_0 = K^*(a, \\tau)/(\\lambda f')$ of the closed form (§2) with the smallest
    $a = \\mu'_j$, half the longest delay and the largest gain $\\lambda_i f'_j$ of the
    supports: the symmetric scaling, right to a small factor where one pair dominates."""
    tmax = float(lin.delays[-1])
    gain = max(
        float(lin.arrival_rate[i] * lin.cost_prime[list(S)].max())
        for i, S in zip(lin.sources, lin.supports)
    )
    a = min(float(lin.rate_prime[list(S)].min()) for S in lin.supports)
    if not (tmax > 0 and a > 0 and gain > 0 and math.isfinite(gain)):
        return 0.03 / (max(tmax, 1e-3) * max(gain, 1e-12))
    return symmetric_critical_gain(a, 0.5 * tmax) / gain


def bracket(unstable, eta0: float):
    """`(lo, hi)` with `unstable(lo)` False and `unstable(hi)` True, by doubling/halving
    from `eta0`; `(inf, inf)` if still stable at $2^{80}\\eta_0$, `(0, 0)` if unstable at
    $2^{-80}\\eta_0$."""
    lo = hi = eta0
    if not unstable(eta0):
        for _ in range(80):
            hi = 2.0 * lo
            if unstable(hi):
                return lo, hi
            lo = hi
        return math.inf, math.inf
    for _ in range(80):
        lo = 0.5 * hi
        if not unstable(lo):
            return lo, hi
        hi = lo
    return 0.0, 0.0


def say(msg: str) -> None:
    """One progress line on stderr."""
    print(msg, file=sys.stderr, flush=True)


def result(lin, pol, eta, method, root, nodes, tau_scale) -> StabilityResult:
    """The `StabilityResult` of a search (the period from the crossing root)."""
    w = abs(root.imag) if math.isfinite(eta) and eta > 0 else math.nan
    return StabilityResult(
        critical_step_size=float(eta),
        method=method,
        rightmost_root=complex(root),
        crossing_frequency=float(w),
        period=float(2.0 * math.pi / w) if w and math.isfinite(w) and w > 0 else math.nan,
        nodes=int(nodes),
        N=lin.N,
        x=lin.x,
        policy=pol.name,
        tau_scale=float(tau_scale),
        linearisation=lin,
    )


def begin(lin: Linearisation, name: str, progress: bool) -> tuple[float, Steps]:
    """The start of a crossing search: its progress line, the initial guess and `Steps`."""
    if progress:
        say(
            f"stability: linearised, {lin.dim} states, {len(lin.sources)} routing sources, "
            f"{lin.delays.size} delays; {name} crossing search"
        )
    return initial_guess(lin), Steps(progress, f"stability ({name})", 8)
