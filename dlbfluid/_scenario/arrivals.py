"""Arrival-rate profiles: piecewise-linear rates with constant extrapolation.

A profile of cell $i$ is a list of breakpoints $(t_p, r_p)$, $p = 0..P-1$, with
non-decreasing times. The rate is the linear interpolant between breakpoints and is
constant before $t_0$ and after $t_{P-1}$; a repeated time is a jump, so piecewise-constant
profiles are the special case of paired breakpoints. A constant rate is $P = 1$.
Profiles of different lengths are padded by repeating their last breakpoint, which adds
zero-length segments and changes nothing (theory/discretisation.md, *Arrivals*).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._shapes import lead


def rate_at(times: Float[Array, " P"], rates: Float[Array, " P"], t):
    """$\\lambda(t)$ for one profile; `t` may be any shape."""
    return jnp.interp(t, times, rates)


def rate_integral(times: Float[Array, " P"], rates: Float[Array, " P"], a, b):
    """$\\int_a^b \\lambda(s)\\,ds$ for one profile, for `a <= b` of any (broadcast) shape.

    Computed as a sum over segments of the overlap area, never as a difference of
    cumulative integrals, so it keeps its relative accuracy on long horizons in float32.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a), jnp.asarray(b))
    t0, tP = times[0], times[-1]
    r0, rP = rates[0], rates[-1]
    # Constant extrapolation on (-inf, t0] and [tP, inf).
    left = r0 * jnp.maximum(jnp.minimum(b, t0) - a, 0.0)
    right = rP * jnp.maximum(b - jnp.maximum(a, tP), 0.0)
    if times.shape[0] == 1:
        return left + right
    ts, te, rs, re = (lead(v, a.ndim + 1) for v in (times[:-1], times[1:], rates[:-1], rates[1:]))
    lo = jnp.clip(a[..., None], ts, te)
    hi = jnp.clip(b[..., None], ts, te)
    span = te - ts
    safe = jnp.where(span > 0, span, 1.0)
    slope = jnp.where(span > 0, (re - rs) / safe, 0.0)
    r_lo = rs + slope * (lo - ts)
    r_hi = rs + slope * (hi - ts)
    middle = jnp.sum(0.5 * (hi - lo) * (r_lo + r_hi), axis=-1)
    return left + middle + right


def rate_slope(times: Float[Array, " P"], rates: Float[Array, " P"], t):
    """$\\lambda'(t)$ for one profile (the slope of the linear piece containing `t`; 0 before
    the first and after the last breakpoint); `t` may be any shape."""
    t = jnp.asarray(t)
    if times.shape[0] == 1:
        return jnp.zeros_like(t)
    ts, te = times[:-1], times[1:]
    rs, re = rates[:-1], rates[1:]
    span = te - ts
    slope = jnp.where(span > 0, (re - rs) / jnp.where(span > 0, span, 1.0), 0.0)
    inside = (lead(ts, t.ndim + 1) <= t[..., None]) & (t[..., None] < lead(te, t.ndim + 1))
    return jnp.sum(jnp.where(inside, lead(slope, t.ndim + 1), 0.0), axis=-1)
