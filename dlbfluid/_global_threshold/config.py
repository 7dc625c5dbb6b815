"""`WorstCaseSearch`: the settings of the global-threshold search."""

from __future__ import annotations

import equinox as eqx
import numpy as np

from .._validate import integer, invalid, number

HOPF = ("subcritical", "supercritical")
"""The values of `hopf` (or `None` when no cycle was found on the ladder)."""


class WorstCaseSearch(eqx.Module):
    """Configuration of `global_threshold`.

    **Fields:**
    - `starts`: starts per scenario (the same at every rung): `vertex_starts` cold vertex
      starts, the rest random.
    - `vertex_starts`: starts with $N(0) = 0$ and every router on one corner of its simplex
      (start $v$ puts router $i$ on its $(v \\bmod m_i)$-th allowed arc; start 0 is "all
      routing to the first allowed cell"). At most `starts`.
    - `ladder_ratio`: $r$, the ratio between rungs, in $(1, 1.05]$.
    - `rungs_below`, `rungs_above`: $K$ rungs $\\eta^*r^{-K}, \\dots, \\eta^*r^{-1}$ and
      rungs $\\eta^*r, \\dots$ above. $\\eta^*$ itself is not a rung: there the
      linearisation is neutral and a decaying run decays only algebraically. The default
      8 reaches $0.68\\eta^*$ at $r = 1.05$: measured $\\eta_g/\\eta^*$ on the symmetric
      pair is 0.86, 0.82, 0.68 and 0.53 at $\\tau$ = 0.25, 0.5, 1 and 2
      (notebooks/stepsize_delay_tradeoff.ipynb), so longer delays need more rungs (14 for
      $\\tau = 2$); a search whose lowest rung already fails reports `eta_global` None
      (below the ladder), never a value.
    - `horizon`, `tick`: $T$ and $h$ of every run (`horizon` a whole number of ticks).
    - `late_window`: the fraction of the horizon at its end whose two halves the decay
      test compares (`non_decaying`); 0.5: the third and the last quarter.
    - `workload_scale`: random $N_j(0) \\sim U[0, s(1 + N_j^*)]$.
    - `dirichlet`: the concentration of random routings (below 1 favours faces).
    - `decay_ratio`: a run decays when its last-quarter mean gap is below this fraction of
      the third quarter's (`non_decaying`).
    - `amplitude_tol`: a run decays when its last-quarter peak-to-peak workload is below
      this times $\\bar N = \\max_jN_j^*$.
    - `onset_amplitude`: with no cycle below $\\eta^*$, the Hopf bifurcation counts as
      subcritical when the sustained oscillation at the first rung above $\\eta^*$ is at
      least this times $\\bar N$ (a supercritical branch starts from zero amplitude,
      $A \\propto \\sqrt{\\eta/\\eta^* - 1}$; a subcritical one jumps to a finite cycle).
    - `ascent_steps`: gradient-ascent refinements of every start (0: none).
    - `ascent_horizon`: the horizon of the ascent objective (its late window is the last
      half).
    - `ascent_rate`: the step of the normalised ascent, as a fraction of $1 + N_j^*$ for
      workloads and of the simplex for routings.
    - `seed`: the random starts' seed.
    """

    starts: int = 16
    vertex_starts: int = 2
    ladder_ratio: float = 1.05
    rungs_below: int = 8
    rungs_above: int = 1
    horizon: float = 300.0
    tick: float = 0.05
    late_window: float = 0.5
    workload_scale: float = 3.0
    dirichlet: float = 0.5
    decay_ratio: float = 0.8
    amplitude_tol: float = 0.01
    onset_amplitude: float = 0.25
    ascent_steps: int = 0
    ascent_horizon: float = 40.0
    ascent_rate: float = 0.25
    seed: int = 0

    def __check_init__(self):
        def bad(name, allowed):
            return invalid(f"WorstCaseSearch.{name}", getattr(self, name), f"expected {allowed}")

        def real(name, **bounds):
            return number(f"WorstCaseSearch.{name}", getattr(self, name), lo_open=True, **bounds)

        for name, lo in (("starts", 1), ("vertex_starts", 0), ("rungs_below", 1),
                         ("rungs_above", 0), ("ascent_steps", 0), ("seed", 0)):  # fmt: skip
            integer(f"WorstCaseSearch.{name}", getattr(self, name), lo)
        if self.vertex_starts > self.starts:
            raise bad("vertex_starts", f"an integer <= starts = {self.starts}")
        real("ladder_ratio", lo=1, hi=1.05)
        for name in ("horizon", "tick", "workload_scale", "dirichlet", "ascent_horizon",
                     "ascent_rate", "amplitude_tol", "onset_amplitude"):  # fmt: skip
            real(name, lo=0)
        real("decay_ratio", lo=0, hi=1, hi_open=True)
        real("late_window", lo=0, hi=1)
        for name in ("horizon", "ascent_horizon"):
            K = getattr(self, name) / self.tick
            if abs(K - round(K)) > 1e-9 * max(K, 1.0) or round(K) < 8:
                raise bad(name, f"a whole number (>= 8) of ticks of {self.tick}")

    def rungs(self) -> np.ndarray:
        """The exponents $k$ of the ladder, ascending ($0$ excluded)."""
        return np.array(
            list(range(-self.rungs_below, 0)) + list(range(1, self.rungs_above + 1)), dtype=int
        )
