"""$e^x$ for $x \\le 0$ and $\\ln(1 + e)$ for $0 \\le e \\le 1$ as plain arithmetic.

The softplus service model and the gradient cost evaluate one exponential and one
logarithm per cell and per arc at every tick (`softplus_sigmoid`). XLA's CPU backend emits
`exp` and `log1p` of float64 as calls to scalar library routines, and a fused loop holding
such a call runs as scalar code from end to end. Written as multiplies, adds, one rounding
and one exponent-field shift, the same loop vectorises: on 128 App.-B ten-cell scenarios
at 5 ms ticks this took a scenario-tick from 9.2 to 7.8 microseconds in float64 and from
10.8 to 7.6 in float32 on one CPU core (best of three rounds; theory/discretisation.md,
*The loop at the probe cadence*).

Both are accurate to about one unit in the last place of their dtype (float64 or
float32), checked against numpy's float64 functions by `tests/test_elementary.py`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# Cody-Waite splitting of ln 2: the high part has enough trailing zero bits that k * hi is
# exact for every exponent k that can occur, so r = x - k ln 2 loses nothing.
_LN2 = {
    "float64": (6.93147180369123816490e-01, 1.90821492927058770002e-10),
    "float32": (6.93145751953125e-01, 1.428606765330187045e-06),
}
# Below these, e^x is under the smallest normal number; the result is flushed to 0.
_EXP_FLOOR = {"float64": -708.0, "float32": -87.0}
# Degrees that make the truncation error of the series under half a unit in the last place:
# for |r| <= ln(2)/2, |r|^(d+1)/(d+1)! is 4e-18 at d = 13 and 5e-9 at d = 7.
_EXP_DEGREE = {"float64": 13, "float32": 7}
# Terms of the atanh series of log1p: with s <= 1/3, s^(2t) / (2t + 1) < eps / 4.
_LOG_TERMS = {"float64": 15, "float32": 7}


def _name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in _LN2:
        raise ValueError(f"dtype = {name} is invalid: allowed float64 or float32")
    return name


def exp_neg(x):
    """$e^x$ for $x \\le 0$ (float64 or float32).

    $x = k\\ln 2 + r$ with $k$ the nearest integer to $x/\\ln 2$ and $|r| \\le \\ln(2)/2$
    (Cody-Waite: $r$ is exact); $e^r$ by its Taylor polynomial of degree 13 (float64) or 7
    (float32) in Horner form; $2^k$ by writing $k$ into the exponent field. Results below
    the smallest normal number ($x < -708$ in float64, $-87$ in float32) are 0. Positive
    $x$ are outside the contract (they would lose the range reduction's guarantee)."""
    name = _name(x.dtype)
    hi, lo = _LN2[name]
    deg = _EXP_DEGREE[name]
    xc = jnp.maximum(x, _EXP_FLOOR[name])
    k = jnp.round(xc * (1.0 / math.log(2.0)))
    r = (xc - k * hi) - k * lo
    p = jnp.full_like(r, 1.0 / math.factorial(deg))
    for j in range(deg - 1, -1, -1):
        p = p * r + 1.0 / math.factorial(j)
    if name == "float64":
        scale = lax.bitcast_convert_type((k.astype(jnp.int64) + 1023) << 52, jnp.float64)
    else:
        scale = lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)
    return jnp.where(x < xc, 0.0, p * scale)


def log1p_unit(e):
    """$\\ln(1 + e)$ for $0 \\le e \\le 1$ (float64 or float32).

    $\\ln(1 + e) = 2\\,\\mathrm{atanh}(s) = 2(s + s^3/3 + s^5/5 + \\dots)$ with
    $s = e/(2 + e) \\in [0, 1/3]$: no cancellation, and 15 (float64) or 7 (float32) terms
    bring the truncation under a quarter of a unit in the last place. Exact at $e = 0$."""
    name = _name(e.dtype)
    terms = _LOG_TERMS[name]
    s = e / (2.0 + e)
    z = s * s
    p = jnp.full_like(z, 1.0 / (2 * terms + 1))
    for j in range(terms - 1, -1, -1):
        p = p * z + 1.0 / (2 * j + 1)
    return 2.0 * s * p
