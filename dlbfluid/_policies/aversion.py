"""Error aversion: roots shift traffic away from cells that drop requests (seed §3.4).

The seed describes the mechanism but not its equations; the fluid version here is ours
(theory/evaluation.md, *Error aversion*):

* each cell keeps an exponential moving average $e_j$ of the fraction of its arrivals
  that it drops, with time constant $T_e$: over a tick of length $h$,
  $e_j \\leftarrow e_j + (1 - e^{-h/T_e})(d_j/a_j - e_j)$ (`ema_update`);
* root $i$ sees $e_j$ through the probe, $\\tau_{ij}$ late, and keeps an aversion
  $a_{ij} \\in [0, a_{\\max}]$ per cell, driven by the excess over the best cell it can
  reach, $\\delta_{ij} = \\hat e_{ij} - \\min_{l \\in C^+(i)} \\hat e_{il}$:
  $\\dot a_{ij} = \\kappa(\\delta_{ij} - \\theta)^+$ while $\\delta_{ij} > \\theta$, and
  $\\dot a_{ij} = -\\rho$ (recovery) once the cell is within $\\theta$ of the best
  (`aversion_update`, forward Euler on the tick);
* the routing actually sent is the policy's, thinned by the aversion and renormalised:
  $\\tilde x_{ij} = x_{ij}(1-a_{ij}) / \\sum_l x_{il}(1-a_{il})$ (`apply_aversion`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp


class ErrorAversion(eqx.Module):
    """Configuration of the error-aversion loop (all times in seconds).

    **Fields:**
    - `ema_time`: $T_e$, time constant of the cells' error-rate moving average.
    - `threshold`: $\\theta$, the excess error fraction over the best cell that is tolerated.
    - `gain`: $\\kappa$ (1/s per unit excess), how fast aversion builds up.
    - `recovery`: $\\rho$ (1/s), how fast aversion decays once the cell is healthy again.
    - `max_aversion`: $a_{\\max} < 1$, so that a root never fully abandons a cell and keeps
      observing it (the recovery detection of seed §3.4).
    """

    ema_time: float = 5.0
    threshold: float = 0.01
    gain: float = 10.0
    recovery: float = 0.05
    max_aversion: float = 0.95

    def __check_init__(self):
        for f in ("ema_time", "gain", "recovery"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{f} = {v!r} is invalid: expected a finite number > 0")
        if not (isinstance(self.threshold, (int, float)) and 0 <= self.threshold < 1):
            raise ValueError(f"threshold = {self.threshold!r} is invalid: expected 0 <= value < 1")
        if not (isinstance(self.max_aversion, (int, float)) and 0 <= self.max_aversion < 1):
            raise ValueError(
                f"max_aversion = {self.max_aversion!r} is invalid: expected 0 <= value < 1"
            )


def ema_update(cfg: ErrorAversion, ema, drops, arrivals, h):
    """One tick of the cells' error-rate moving average (exact for a constant rate)."""
    frac = jnp.where(arrivals > 0, drops / jnp.where(arrivals > 0, arrivals, 1.0), 0.0)
    alpha = -jnp.expm1(-h / cfg.ema_time)
    return ema + alpha * (jnp.clip(frac, 0.0, 1.0) - ema)


def aversion_update(cfg: ErrorAversion, a, seen, allowed, h):
    """Forward-Euler tick of the roots' aversion from the observed `(n, n)` error rates."""
    best = jnp.min(jnp.where(allowed, seen, jnp.inf), axis=-1, keepdims=True)
    excess = jnp.where(allowed, seen - jnp.where(jnp.isfinite(best), best, 0.0), 0.0)
    up = cfg.gain * jnp.maximum(excess - cfg.threshold, 0.0)
    rate = jnp.where(excess > cfg.threshold, up, -cfg.recovery)
    return jnp.where(allowed, jnp.clip(a + h * rate, 0.0, cfg.max_aversion), 0.0)


def apply_aversion(x, a):
    """$\\tilde x_{ij} = x_{ij}(1-a_{ij})/\\sum_l x_{il}(1-a_{il})$ (rows with no mass left
    keep $x$)."""
    w = x * (1.0 - a)
    tot = jnp.sum(w, axis=-1, keepdims=True)
    return jnp.where(tot > 1e-12, w / jnp.where(tot > 1e-12, tot, 1.0), x)
