"""The closed form for one origin routing between two identical cells (theory/stability.md §2).

With $u = \\delta N_1 - \\delta N_2$ and $y = \\delta x_1$ the linearisation has the
characteristic equation $s(s+a) + Ke^{-2\\tau s} = 0$, $a = \\mu'(N^*)$,
$K = \\eta\\lambda f'(N^*)$; it is stable iff $2\\tau\\omega_c < \\arctan(a/\\omega_c)$,
$\\omega_c^2 = (\\sqrt{a^4+4K^2} - a^2)/2$. `symmetric_parameters` recognises that structure
in a `Linearisation`; `Symmetric` is the member of the method family that uses it.
"""

from __future__ import annotations

import math
from typing import ClassVar

import scipy.optimize

from .base import NO_ROOT, AbstractStabilityMethod


def omega_c(a: float, K: float) -> float:
    """$\\omega_c$ with $\\omega_c^2 = (\\sqrt{a^4 + 4K^2} - a^2)/2 = 2K^2/(\\sqrt{a^4+4K^2}+a^2)$
    (the second form has no cancellation when $K \\ll a^2$)."""
    return math.sqrt(2.0 * K * K / (math.sqrt(a**4 + 4.0 * K * K) + a * a))


def symmetric_crossing_margin(a: float, K: float, tau: float) -> float:
    """$\\arctan(a/\\omega_c) - 2\\tau\\omega_c$: positive iff $s(s+a) + Ke^{-2\\tau s} = 0$ has
    all its roots in the open left half-plane (theory/stability.md §2).

    **Arguments:** `a` $= \\mu'(N^*) > 0$, `K` $= \\eta\\lambda f'(N^*) > 0$, `tau` $= \\tau \\ge 0$.
    """
    w = omega_c(a, K)
    return math.atan2(a, w) - 2.0 * tau * w


def symmetric_critical_gain(a: float, tau: float) -> float:
    """The gain $K^*$ with $2\\tau\\omega_c(K^*) = \\arctan(a/\\omega_c(K^*))$, by Brent's method
    in $K$ to $10^{-15}$ relative; $+\\infty$ when $\\tau = 0$ (theory/stability.md §2)."""
    if not (math.isfinite(a) and a > 0):
        raise ValueError(f"a = {a!r} is invalid: expected mu'(N*) > 0")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau = {tau!r} is invalid: expected a finite delay >= 0")
    if tau == 0:
        return math.inf
    # The margin decreases strictly in K (omega_c increases): bracket, then Brent.
    lo = hi = a * a
    while symmetric_crossing_margin(a, hi, tau) > 0:
        hi *= 2.0
    while symmetric_crossing_margin(a, lo, tau) < 0:
        lo *= 0.5
    return scipy.optimize.brentq(
        lambda K: symmetric_crossing_margin(a, K, tau),
        lo,
        hi,
        xtol=1e-300,
        rtol=1e-15,
        maxiter=500,
    )


def symmetric_critical_step_size(a: float, fprime: float, lam: float, tau: float) -> float:
    """Critical step size of one origin routing to two identical cells (theory/stability.md §2).

    The linearisation ($u = \\delta N_1 - \\delta N_2$, $y = \\delta x_1$) has the
    characteristic equation $s(s+a) + Ke^{-2\\tau s} = 0$ with $K = \\eta\\lambda f'(N^*)$,
    $a = \\mu'(N^*)$; it is stable iff $2\\tau\\omega_c < \\arctan(a/\\omega_c)$,
    $\\omega_c^2 = (\\sqrt{a^4+4K^2} - a^2)/2$. Returns $\\eta^* = K^*/(\\lambda f'(N^*))$ with
    $K^*$ from `symmetric_critical_gain` (theory/stability.md §2).

    **Arguments:**
    - `a`: $\\mu'(N^*)$, the marginal processing rate of either cell at equilibrium.
    - `fprime`: $f'(N^*)$, the derivative of the destination cost.
    - `lam`: $\\lambda$, the arrival rate of the origin.
    - `tau`: $\\tau$, the one-way delay of both arcs (the loop delay is $2\\tau$).

    **Returns:** $\\eta^*$ (`inf` when $\\tau = 0$).

    **Raises:** `ValueError` for a non-positive `a`, `fprime`, `lam` or a negative `tau`.
    """
    for name, v in (("fprime", fprime), ("lam", lam)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} = {v!r} is invalid: expected a finite number > 0")
    return symmetric_critical_gain(float(a), float(tau)) / (lam * fprime)


def symmetric_parameters(lin, rtol: float = 1e-10):
    """`(a, fprime, lam, tau)` when the linearisation is one origin routing between two
    identical cells over equal delays (the §6.1 structure), else None."""
    if len(lin.sources) != 1 or len(lin.supports[0]) != 2:
        return None
    i = lin.sources[0]
    j, k = lin.supports[0]
    a, fp, tau = lin.rate_prime, lin.cost_prime, lin.arc_delay

    def close(u, v):
        return abs(u - v) <= rtol * max(abs(u), abs(v))

    if close(a[j], a[k]) and close(fp[j], fp[k]) and close(tau[i, j], tau[i, k]):
        return float(a[j]), float(fp[j]), float(lin.arrival_rate[i]), float(tau[i, j])
    return None


class Symmetric(AbstractStabilityMethod):
    """The closed form of theory/stability.md §2 (`symmetric_critical_step_size`) as a
    method of `critical_step_size`: only for the structure `symmetric_parameters` finds."""

    name: ClassVar[str] = "symmetric"

    @classmethod
    def named(cls, nodes: int) -> Symmetric:
        return cls()

    def check(self, lin, symmetric) -> None:
        if symmetric is None:
            raise ValueError(
                "method = 'symmetric' is invalid for this scenario: the closed form needs "
                "exactly one origin routing between two cells with equal mu'(N*), f'(N*) and "
                "one-way delay (found routing sources "
                f"{list(lin.sources)} with supports {[list(S) for S in lin.supports]}); "
                "use method='pseudospectral'"
            )

    def solve(self, lin, symmetric, *, rtol: float, progress: bool):
        self.check(lin, symmetric)
        a, fp, lam, tau = symmetric
        eta = symmetric_critical_step_size(a, fp, lam, tau)
        root = complex(0.0, omega_c(a, eta * lam * fp)) if math.isfinite(eta) else NO_ROOT
        return eta, root, self.name, 0

    def no_crossing(self) -> tuple[str, int]:
        return "pseudospectral", 0
