"""One inference server of the generator (seed App. B; theory/generator.md, *Server*,
*Workload*, *Buffer*): disaggregated prefill and decode engines, the shifted-Gamma token
counts of a request, the softplus fluid model that summarises a server (`server_service`)
and the buffer that holds a cell's steady-state workload near capacity (`buffer_size`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from .._runtime.eager import eager_jit
from .._service import Softplus

PREFILL_ENGINES = 1
DECODE_ENGINES = 2
DECODE_SLOTS = 4
"""One server: 1 prefill engine and 2 decode engines of 4 parallel slots (seed App. B)."""

PREFILL_TOKEN_TIME_S = 1.25e-4
"""Mean prefill time per token (8000 prompt tokens/s per prefill engine)."""
DECODE_TOKEN_TIME_S = 4.0e-3
"""Mean decode time per output token and slot (250 tokens/s per slot)."""

BUFFER_LOAD = 0.98
"""A cell's buffer holds the steady-state workload of that cell at 98% of its capacity."""


@dataclasses.dataclass(frozen=True)
class ShiftedGamma:
    """Token count $X = \\delta + G$, $G \\sim \\mathrm{Gamma}(\\alpha, \\theta)$ (shape, scale).

    Mean $\\delta + \\alpha\\theta$, variance $\\alpha\\theta^2$, squared coefficient of
    variation $\\alpha\\theta^2/(\\delta+\\alpha\\theta)^2$ (theory/generator.md, *Workload*).
    """

    shift: float
    shape: float
    scale: float

    @property
    def mean(self) -> float:
        return self.shift + self.shape * self.scale

    @property
    def scv(self) -> float:
        return self.shape * self.scale**2 / self.mean**2

    def sample(self, rng: np.random.Generator, size=None) -> np.ndarray:
        """Draw token counts (real-valued; the fluid model needs only the moments)."""
        return self.shift + rng.gamma(self.shape, self.scale, size)


PREFILL_TOKENS = ShiftedGamma(shift=100.0, shape=1.5, scale=600.0)
"""Prompt tokens per request: mean 1000, SCV 0.54."""
DECODE_TOKENS = ShiftedGamma(shift=10.0, shape=1.2, scale=200.0)
"""Output tokens per request: mean 250, SCV 0.768."""
WORKLOAD = {
    "prompt_tokens": dataclasses.asdict(PREFILL_TOKENS),
    "output_tokens": dataclasses.asdict(DECODE_TOKENS),
}
"""The scenario files' `"workload"` of the generated scenarios (the two laws above)."""


def server_service(
    prefill_token_time,
    decode_token_time,
    *,
    prefill_tokens: ShiftedGamma = PREFILL_TOKENS,
    decode_tokens: ShiftedGamma = DECODE_TOKENS,
) -> dict[str, np.ndarray]:
    """Softplus parameters of one disaggregated server (theory/generator.md, *Server*).

    With $T_p = \\bar P t_p$ and $T_d = \\bar D t_d$ the mean prefill and decode work of a
    request ($\\bar P$, $\\bar D$ mean token counts; $t_p$, $t_d$ token times):
    - stage capacities $c_p = 1/T_p$ (one prefill engine), $c_d = 8/T_d$ (2 x 4 slots);
      server capacity $c = \\min(c_p, c_d)$;
    - unloaded latency $L_0 = T_p + T_d$;
    - asymptote offset $a_0 = (1 + c_s^2)/(2c)$, $c_s^2$ the SCV of the bottleneck stage's
      token count (heavy-traffic match of the $1/(1-\\rho)$ pole, Pollaczek-Khinchine);
    - saturation concurrency $n^* = cL_0$, knee $n_0 = n^* - c\\,a_0$ (so
      $a_0 = L_0 - n_0/c > 0$), width $s = \\sqrt{n^*}$ (square-root staffing scale).

    **Returns:** a dict of arrays `capacity`, `base_latency`, `knee`, `width`, `a0`,
    `prefill_bound` (True where prefill is the bottleneck).
    """
    tp = np.asarray(prefill_token_time, dtype=float)
    td = np.asarray(decode_token_time, dtype=float)
    Tp = prefill_tokens.mean * tp
    Td = decode_tokens.mean * td
    cp = PREFILL_ENGINES / Tp
    cd = DECODE_ENGINES * DECODE_SLOTS / Td
    prefill_bound = cp <= cd
    c = np.minimum(cp, cd)
    scv = np.where(prefill_bound, prefill_tokens.scv, decode_tokens.scv)
    L0 = Tp + Td
    a0 = (1.0 + scv) / (2.0 * c)
    nstar = c * L0
    return {
        "capacity": c,
        "base_latency": L0,
        "knee": nstar - c * a0,
        "width": np.sqrt(nstar),
        "a0": a0,
        "prefill_bound": prefill_bound,
    }


@eager_jit
def _softplus_latency(p, N):
    return Softplus().latency(p, N)


def softplus_latency(N, capacity, base_latency, knee, width) -> np.ndarray:
    """$\\ell(N) = L_0 + (s/\\bar\\mu)\\,\\mathrm{sp}((N-N_0)/s)$, float64 (the softplus law,
    `dlbfluid._service.Softplus.latency`), as numpy: one compiled program per shape with
    the eager evaluation's numbers (`eager_jit`; `buffer_size` calls it at every halving)."""
    p = {
        "capacity": jnp.asarray(capacity, jnp.float64),
        "base_latency": jnp.asarray(base_latency, jnp.float64),
        "knee": jnp.asarray(knee, jnp.float64),
        "width": jnp.asarray(width, jnp.float64),
    }
    return np.asarray(_softplus_latency(p, jnp.asarray(N, jnp.float64)))


def buffer_size(capacity, base_latency, knee, width, *, load: float = BUFFER_LOAD) -> np.ndarray:
    """Workload $B$ with $\\mu(B) = \\rho_B\\bar\\mu$: the steady state at load $\\rho_B$.

    Solved by bisection on $[0, B_{hi}]$ with the bound (theory/generator.md, *Buffer*)
    $B \\le \\rho_B\\max\\{\\bar\\mu L_0 + s\\ln 2,\\ (\\bar\\mu a_0 + s\\ln2)/(1-\\rho_B)\\}$;
    at most 200 halvings, stopped once one changes neither end (float64 resolution, about
    56 halvings: the ends are then fixed, so the result is that of all 200).
    """
    if not 0.0 < load < 1.0:
        raise ValueError(f"load = {load!r} is invalid: expected 0 < load < 1")
    C, L0, N0, s = (np.asarray(v, dtype=float) for v in (capacity, base_latency, knee, width))
    a0 = L0 - N0 / C
    lo = np.zeros(np.broadcast_shapes(C.shape, L0.shape, N0.shape, s.shape))
    hi = (
        1.01
        * load
        * np.maximum(C * L0 + s * math.log(2.0), (C * a0 + s * math.log(2.0)) / (1.0 - load))
        + 1.0
    )
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        below = mid < load * C * softplus_latency(mid, C, L0, N0, s)  # mu(mid) < load * C
        new_lo, new_hi = np.where(below, mid, lo), np.where(below, hi, mid)
        if np.array_equal(new_lo, lo, equal_nan=True) and np.array_equal(
            new_hi, hi, equal_nan=True
        ):
            break
        lo, hi = new_lo, new_hi
    return 0.5 * (lo + hi)
