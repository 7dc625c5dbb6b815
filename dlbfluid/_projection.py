"""Euclidean projection onto the probability simplex restricted to allowed arcs."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._shapes import lead


def project_simplex(v: Float[Array, "... n"], mask: Bool[Array, "... n"]) -> Float[Array, "... n"]:
    """$\\Pi_{\\Delta}(v) = \\arg\\min_{z \\in \\Delta} \\|z - v\\|_2$ over the last axis, with
    $\\Delta = \\{z \\ge 0, \\sum_j z_j = 1, z_j = 0 \\text{ where not } \\texttt{mask}_j\\}$.

    Sort-based threshold (Held, Wolfe and Crowder; theory/model.md, *Policies*): with $u$ the
    allowed entries sorted in decreasing order, $\\rho = \\max\\{k: u_k > (\\sum_{l\\le k}
    u_l - 1)/k\\}$ and $\\theta = (\\sum_{l \\le \\rho} u_l - 1)/\\rho$, the projection is
    $(v - \\theta)^+$ on allowed entries. Rows with no allowed entry return zeros.
    """
    n = v.shape[-1]
    count = jnp.sum(mask, axis=-1, keepdims=True)
    vmin = jnp.min(jnp.where(mask, v, jnp.inf), axis=-1, keepdims=True)
    vmin = jnp.where(count > 0, vmin, 0.0)
    # Disallowed entries sort last; they never enter the threshold because of `valid`.
    filled = jnp.where(mask, v, vmin - 1.0)
    u = -jnp.sort(-filled, axis=-1)
    k = lead(jnp.arange(1, n + 1, dtype=v.dtype), v.ndim)
    css = jnp.cumsum(u, axis=-1) - 1.0
    valid = k <= count
    cond = (u - css / k > 0) & valid
    rho = jnp.maximum(jnp.sum(cond, axis=-1, keepdims=True), 1)
    theta = jnp.take_along_axis(css, rho - 1, axis=-1) / rho.astype(v.dtype)
    return jnp.where(mask & (count > 0), jnp.maximum(v - theta, 0.0), 0.0)
