"""Latency percentiles from a log-spaced histogram (theory/requests.md, *Percentiles*)."""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp


class LatencyHistogram(eqx.Module):
    """Log-spaced latency bins: `bins` bins of equal ratio
    $r = (\\text{high}/\\text{low})^{1/\\text{bins}}$ between `low` and `high` seconds, plus
    an underflow bin (index 0) and an overflow bin (index `bins + 1`).

    A percentile is read by interpolating log-uniformly inside the bin where the
    cumulative count crosses it (`percentile`), so its relative error is below one bin,
    $r - 1$ (`resolution`; 0.90% for the defaults, 2048 bins over $[10^{-4}, 10^4]$ s).
    A percentile that falls in the underflow or overflow bin is `nan`.
    """

    low: float = 1e-4
    high: float = 1e4
    bins: int = 2048

    def __check_init__(self):
        ok = (
            isinstance(self.low, (int, float))
            and isinstance(self.high, (int, float))
            and 0 < self.low < self.high < math.inf
        )
        if not ok:
            raise ValueError(
                f"histogram low = {self.low!r}, high = {self.high!r} are invalid: expected "
                "finite numbers 0 < low < high"
            )
        if not isinstance(self.bins, int) or isinstance(self.bins, bool) or self.bins < 1:
            raise ValueError(f"histogram bins = {self.bins!r} is invalid: expected an integer >= 1")

    @property
    def log_ratio(self) -> float:
        return math.log(self.high / self.low) / self.bins

    @property
    def resolution(self) -> float:
        """Relative width of one bin, $r - 1$: a bound on a percentile's relative error."""
        return math.expm1(self.log_ratio)

    def index(self, latency):
        """Bin of each latency: 0 below `low`, `bins + 1` at or above `high`."""
        x = jnp.log(jnp.maximum(latency, self.low * 1e-3) / self.low) / self.log_ratio
        i = jnp.floor(x).astype(jnp.int32) + 1
        return jnp.clip(jnp.where(latency < self.low, 0, i), 0, self.bins + 1)

    def percentile(self, counts, q: float):
        """The `q`-quantile ($0 < q < 1$) of the latencies counted in `counts`
        (`(..., bins + 2)`): the point where the cumulative count reaches $q$ times the
        total, log-uniform inside its bin; `nan` without counts or outside the range."""
        c = jnp.asarray(counts).astype(jnp.result_type(float))
        total = jnp.sum(c, axis=-1, keepdims=True)
        cum = jnp.cumsum(c, axis=-1)
        target = q * total
        i = jnp.sum(cum < target, axis=-1)  # first bin whose cumulative count reaches it
        i = jnp.minimum(i, self.bins + 1)
        before = jnp.take_along_axis(cum - c, i[..., None], axis=-1)[..., 0]
        inside = jnp.take_along_axis(c, i[..., None], axis=-1)[..., 0]
        frac = jnp.clip((target[..., 0] - before) / jnp.maximum(inside, 1.0), 0.0, 1.0)
        value = self.low * jnp.exp((i - 1 + frac) * self.log_ratio)
        bad = (i == 0) | (i == self.bins + 1) | (total[..., 0] == 0)
        return jnp.where(bad, jnp.nan, value)
