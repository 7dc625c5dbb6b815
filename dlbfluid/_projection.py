"""Euclidean projection onto the probability simplex restricted to allowed arcs."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._shapes import lead


def project_simplex(
    v: Float[Array, "... n"], mask: Bool[Array, "... n"], *, method: str = "auto"
) -> Float[Array, "... n"]:
    """$\\Pi_{\\Delta}(v) = \\arg\\min_{z \\in \\Delta} \\|z - v\\|_2$ over the last axis, with
    $\\Delta = \\{z \\ge 0, \\sum_j z_j = 1, z_j = 0 \\text{ where not } \\texttt{mask}_j\\}$.

    The projection is $(v - \\theta)^+$ on allowed entries with the threshold
    $\\theta = \\max_k (\\sum_{l\\le k} u_l - 1)/k$, $u$ the allowed entries in decreasing order
    (Held, Wolfe and Crowder; theory/model.md, *Policies*). `method="sort"` sorts;
    `method="pairwise"` forms, for every allowed entry $a$, the sum and count of the allowed
    entries $\\ge v_a$ ($O(n^2)$ comparisons, no sort: faster for the few cells of a
    router, and the same maximum, since a tie group's candidate is its last prefix);
    `"auto"` takes pairwise up to 32 entries. Rows with no allowed entry return zeros.
    """
    n = v.shape[-1]
    count = jnp.sum(mask, axis=-1, keepdims=True)
    if method == "auto":
        method = "pairwise" if n <= 32 else "sort"
    if method == "pairwise":
        ge = (v[..., None, :] >= v[..., :, None]) & mask[..., None, :]  # [a, b]: v_b >= v_a
        S = jnp.sum(jnp.where(ge, v[..., None, :], 0.0), axis=-1)
        c = jnp.sum(ge, axis=-1).astype(v.dtype)
        cand = jnp.where(mask, (S - 1.0) / jnp.where(mask, c, 1.0), -jnp.inf)
        theta = jnp.max(cand, axis=-1, keepdims=True)
    elif method == "sort":
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
    else:
        raise ValueError(f"method = {method!r} is invalid: allowed 'auto', 'sort', 'pairwise'")
    return jnp.where(mask & (count > 0), jnp.maximum(v - theta, 0.0), 0.0)
