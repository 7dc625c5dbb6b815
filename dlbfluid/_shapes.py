"""Explicit broadcasting (the test suite runs with `jax_numpy_rank_promotion="raise"`)."""

from __future__ import annotations

import jax.numpy as jnp


def lead(x, ndim: int):
    """`x` with singleton axes prepended up to `ndim` axes (unchanged if it has as many)."""
    x = jnp.asarray(x)
    return x.reshape((1,) * (ndim - x.ndim) + x.shape) if x.ndim < ndim else x


def like(x, ref):
    """`x` with singleton axes prepended to the rank of `ref`."""
    return lead(x, jnp.ndim(ref))
