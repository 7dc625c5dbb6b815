"""`WorstCaseSearch`: the settings of the global-threshold search."""

from __future__ import annotations

import math

import equinox as eqx
import numpy as np

from .._validate import check_search_range as check_search_range
from .._validate import integer, invalid, number

HOPF = ("subcritical", "supercritical")
"""The values of `hopf` (or `None` when no verified cycle was found in the range)."""


CENSORING = ("bracketed", "below_range", "above_range", "failed")
"""The values of `eta_global_censoring` (`None` without a usable $\\eta^*$)."""


class WorstCaseSearch(eqx.Module):
    """Configuration of `global_threshold`.

    **Fields:**
    - `starts`: drawn starts per scenario (the same at every step): `vertex_starts` cold
      vertex starts, the rest random; the `ascent_starts` adversarial ones come on top.
    - `vertex_starts`: starts with $N(0) = 0$ and every router on one corner of its simplex
      (start $v$ puts router $i$ on its $(v \\bmod m_i)$-th allowed arc; start 0 is "all
      routing to the first allowed cell"). At most `starts`.
    - `search_range`: $(L, H)$, the lowest and the highest step searched in units of
      $\\eta^*$, $0 < L < H$. A cycle already at $L\\eta^*$ is `"below_range"`, none up
      to $H\\eta^*$ `"above_range"`.
    - `ladder_ratio`: $r$, the largest ratio between the coarse ladder's rungs, in
      $(1, 2]$: the ladder is $L\\rho^k$, $k = 0..K$, $K = \\lceil\\log(H/L)/\\log r\\rceil$,
      $\\rho = (H/L)^{1/K}$ (`rungs`).
    - `bracket_tol`: the bisection stops when $\\eta_{hi} - \\eta_{lo} \\le$
      `bracket_tol` $\\times\\,\\eta_{hi}$, in $(0, 0.5)$ (`bisections`).
    - `horizon`, `tick`: $T$ and $h$ of every run (`horizon` a whole number of ticks).
      The witness is re-simulated at $h/2$ for $2T$ (`verify_amplitude`, `verify_period`).
    - `late_window`: the fraction of the horizon at its end whose two halves the decay
      test compares (`non_decaying`); 0.5: the third and the last quarter.
    - `workload_scale`: random $N_j(0) \\sim U[0, s(1 + N_j^*)]$.
    - `dirichlet`: the concentration of random routings (below 1 favours faces).
    - `decay_ratio`: a run decays when its last-quarter mean gap is below this fraction of
      the third quarter's (`non_decaying`).
    - `amplitude_tol`: a run decays when its last-quarter peak-to-peak workload is below
      this times $\\bar N = \\max_jN_j^*$.
    - `verify_amplitude`, `verify_period`: a witness is accepted when its re-run keeps the
      late amplitude within this relative distance (0.10) and the period within this one
      (0.02) of the search run's.
    - `onset_amplitude`: where the bracket's top lies above $\\eta^*$, the Hopf bifurcation
      counts as subcritical when the witness's amplitude is at least this times
      $\\bar N$ (a supercritical branch starts from zero amplitude,
      $A \\propto \\sqrt{\\eta/\\eta^* - 1}$; a subcritical one jumps to a finite cycle).
    - `ascent_starts`, `ascent_steps`: the adversarial starts: the first `ascent_starts`
      starts refined by `ascent_steps` steps of gradient ascent at $H\\eta^*$ (`_ascend`),
      then offered at every step beside the others (0 of either: none).
    - `ascent_horizon`: the horizon of the ascent objective (its late window is the last
      half).
    - `ascent_rate`: the step of the normalised ascent, as a fraction of $1 + N_j^*$ for
      workloads and of the simplex for routings.
    - `seed`: the random starts' seed.
    """

    starts: int = 16
    vertex_starts: int = 2
    search_range: tuple[float, float] = (0.25, 1.1)
    ladder_ratio: float = 1.25
    bracket_tol: float = 0.01
    horizon: float = 300.0
    tick: float = 0.05
    late_window: float = 0.5
    workload_scale: float = 3.0
    dirichlet: float = 0.5
    decay_ratio: float = 0.8
    amplitude_tol: float = 0.01
    verify_amplitude: float = 0.10
    verify_period: float = 0.02
    onset_amplitude: float = 0.25
    ascent_starts: int = 2
    ascent_steps: int = 4
    ascent_horizon: float = 40.0
    ascent_rate: float = 0.25
    seed: int = 0

    def __check_init__(self):
        def bad(name, allowed):
            return invalid(f"WorstCaseSearch.{name}", getattr(self, name), f"expected {allowed}")

        def real(name, **bounds):
            return number(f"WorstCaseSearch.{name}", getattr(self, name), lo_open=True, **bounds)

        for name, lo in (("starts", 1), ("vertex_starts", 0), ("ascent_starts", 0),
                         ("ascent_steps", 0), ("seed", 0)):  # fmt: skip
            integer(f"WorstCaseSearch.{name}", getattr(self, name), lo)
        if self.vertex_starts > self.starts:
            raise bad("vertex_starts", f"an integer <= starts = {self.starts}")
        if self.ascent_starts > self.starts:
            raise bad("ascent_starts", f"an integer <= starts = {self.starts}")
        check_search_range(self.search_range, "WorstCaseSearch.search_range")
        real("ladder_ratio", lo=1, hi=2)
        real("bracket_tol", lo=0, hi=0.5, hi_open=True)
        for name in ("horizon", "tick", "workload_scale", "dirichlet", "ascent_horizon",
                     "ascent_rate", "amplitude_tol", "onset_amplitude", "verify_amplitude",
                     "verify_period"):  # fmt: skip
            real(name, lo=0)
        real("decay_ratio", lo=0, hi=1, hi_open=True)
        real("late_window", lo=0, hi=1)
        for name in ("horizon", "ascent_horizon"):
            K = getattr(self, name) / self.tick
            if abs(K - round(K)) > 1e-9 * max(K, 1.0) or round(K) < 8:
                raise bad(name, f"a whole number (>= 8) of ticks of {self.tick}")

    def rungs(self) -> np.ndarray:
        """The coarse ladder in units of $\\eta^*$: $L\\rho^k$, $k = 0..K$, ascending, its
        ends exactly $L$ and $H$ (`search_range`)."""
        lo, hi = (float(v) for v in self.search_range)
        K = max(int(math.ceil(math.log(hi / lo) / math.log(self.ladder_ratio) - 1e-12)), 1)
        return lo * (hi / lo) ** (np.arange(K + 1) / K)

    def bisections(self) -> int:
        """Bisections (in $\\log\\eta$) after the coarse ladder: the fewest that bring
        its widest interval, ratio $\\rho$, to $\\eta_{hi}/\\eta_{lo} \\le 1/(1 - tol)$."""
        r = self.rungs()
        ratio = float(np.max(r[1:] / r[:-1]))
        goal = -math.log1p(-self.bracket_tol)
        return max(int(math.ceil(math.log2(math.log(ratio) / goal) - 1e-12)), 0)
