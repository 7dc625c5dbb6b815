"""The arrival window: the breakpoints of the arrival and replica profiles that one tick
reads, in time relative to the tick's start (theory/discretisation.md, *One arrival
window*).

A tick of $[t_k, t_k + h]$ reads the arrival profiles over $[t_k - \\bar\\tau, t_k + h]$
($\\bar\\tau$ the largest delay): `_window_width` counts (host side, static) how many
breakpoints that span can hold, and `_arrival_window` cuts them out of each profile,
searching on from where the last tick's window started.
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._policies import TickSetup

__all__ = ["ArrivalWindow"]


class ArrivalWindow(eqx.Module):
    """The arrival, replica and service profiles as tick $k$ of one scenario needs them, in time
    relative to $t_k$ (theory/discretisation.md, *One arrival window*).

    **Fields:**
    - `times`, `rates`: `(n, W)` the `W` breakpoints of each arrival profile from the last
      one at or before $t_k - \\bar\\tau$ on (all of them when the profile has at most `W`).
    - `replica_times`: `(n, R)` the replica schedules' breakpoints.
    - `slowdown_times`: `(n, S)` the service schedules' breakpoints.
    - `found`: `(n,)` how many breakpoints of each profile lie at or before
      $t_k - \\bar\\tau$ (the next tick's search starts there).

    Times are the breakpoints less $t_k$, the difference taken in float64 and rounded once
    to the run's dtype (`_local`). The loop carries the window: it is made at the end of
    tick $k - 1$ for tick $k$, so that a tick reads it as a small array instead of
    recomputing it inside every loop over arcs that uses it.
    """

    times: Float[Array, "n W"]
    rates: Float[Array, "n W"]
    replica_times: Float[Array, "n R"]
    slowdown_times: Float[Array, "n S"]
    found: Int[Array, " n"]

    def local(self, scn):
        """`scn` with its arrival, replica and service profiles replaced by this window: the
        scenario in time relative to $t_k$, as a tick or a record at tick $k$ reads it."""
        return dataclasses.replace(
            scn,
            arrival_times=self.times,
            arrival_rates=self.rates,
            replica_times=self.replica_times,
            slowdown_times=self.slowdown_times,
        )


def _local(scn, t0):
    """The scenario with its clock started at `t0` (float64): every breakpoint time less
    `t0`, the difference taken in float64 and rounded once to the scenario's dtype, so
    that times near `t0` keep their full relative precision."""
    dtype = scn.arrival_times.dtype

    def shift(ts):
        return (ts.astype(jnp.float64) - t0).astype(dtype)

    return dataclasses.replace(
        scn,
        arrival_times=shift(scn.arrival_times),
        replica_times=shift(scn.replica_times),
        slowdown_times=shift(scn.slowdown_times),
    )


def _found(times, t_lo):
    """How many breakpoints of each profile (rows of `times`) lie at or before `t_lo`."""
    search = functools.partial(jnp.searchsorted, side="right", method="compare_all")
    return jax.vmap(lambda ts: search(ts.astype(t_lo.dtype), t_lo))(times).astype(jnp.int32)


def _cut(times, rates, found, width: int):
    """Each profile's `width` breakpoints from the last one at or before the time that
    `found` counted (`_found`), or from the last `width` ones."""
    start = jnp.clip(found - 1, 0, times.shape[-1] - width)
    cut = functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=width)
    return jax.vmap(cut)(times, start), jax.vmap(cut)(rates, start)


def _arrival_window(full, setup: TickSetup, k, width: int, found=None) -> ArrivalWindow:
    """The `ArrivalWindow` of tick `k`: the breakpoints in $[t_k - \\bar\\tau, t_k + h]$
    and before, relative to $t_k$. `found` (that of tick `k - 1`) makes the search
    incremental: since $t_k - \\bar\\tau$ advances by $h$, fewer than `width` breakpoints
    are passed in one tick (`_window_width` counts those of a longer span), so `width`
    comparisons from the last position replace the search of the whole profile. (Only a
    trailing run of identical breakpoints, which `_window_width` counts once, can be passed
    faster than that; the window then lies inside the run, a constant rate, whatever its
    start.)"""
    tk64 = k.astype(jnp.float64) * setup.h.astype(jnp.float64)
    t_lo = tk64 - jnp.max(setup.tau).astype(jnp.float64)
    ts, rs = full.arrival_times, full.arrival_rates
    P = ts.shape[-1]
    if width >= P:
        found = jnp.zeros(ts.shape[:-1], jnp.int32)
    else:
        if found is None:
            found = _found(ts, t_lo)
        else:
            ahead = found[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
            seen = jnp.take_along_axis(ts, jnp.minimum(ahead, P - 1), axis=-1)
            passed = (seen.astype(jnp.float64) <= t_lo) & (ahead < P)
            found = found + jnp.sum(passed, axis=-1, dtype=jnp.int32)
        ts, rs = _cut(ts, rs, found, width)
    loc = _local(dataclasses.replace(full, arrival_times=ts, arrival_rates=rs), tk64)
    return ArrivalWindow(loc.arrival_times, rs, loc.replica_times, loc.slowdown_times, found)


def _window_width(times: np.ndarray, span: float, rates: np.ndarray | None = None) -> int:
    """Breakpoints a tick can touch: 2 + the most breakpoints of one profile in any
    half-open interval of length `span` (static, from the padded batch).

    A trailing run of identical breakpoints (padding to a common `P`, or a padded cell) is
    counted once: a window that ends inside such a run still ends on the profile's last
    breakpoint, so it stays exact.

    Host side, before tracing, for every profile of the batch at once: profiles are
    sorted, so the interval from $t_p$ holds $t_{p+d}$ for every $d$ up to the largest with
    $t_{p+d} \\le t_p + $ `span`; the loop over $d$ stops at the first $d$ that no profile
    reaches, after about as many passes as the width (10,000 App.-B profiles: 0.12 s one
    profile at a time, a few milliseconds here).
    """
    t = np.asarray(times, dtype=float).reshape(-1, times.shape[-1])
    r = t * 0 if rates is None else np.asarray(rates, dtype=float).reshape(t.shape)
    P = t.shape[-1]
    if P <= 4:
        return P
    same = (t[:, 1:] == t[:, -1:]) & (r[:, 1:] == r[:, -1:])
    keep = P - np.flip(same, axis=1).cumprod(axis=1).sum(axis=1)  # drop the trailing run
    end = t + span * (1 + 1e-9)
    most = 1
    for d in range(1, P):
        kept = np.arange(d, P) < keep[:, None]  # t_{p+d} is a kept breakpoint
        if not np.any(kept & (t[:, d:] <= end[:, :-d])):
            break
        most = d + 1
    return int(min(P, most + 2))
