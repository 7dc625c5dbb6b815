"""Euclidean projection onto the probability simplex restricted to allowed arcs."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._shapes import lead

METHODS = ("auto", "network", "pairwise", "sort")
NETWORK_MAX = 16  # `"auto"`: the network up to this many entries,
PAIRWISE_MAX = 32  # the pairwise sums up to this many, `jnp.sort` beyond


@functools.cache
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for `n` inputs as comparators `(i, j)`, `i < j`: after
    every comparator in turn puts the larger of entries `i` and `j` at `i`, the entries are
    in decreasing order. Built for the next power of two with the comparators that touch an
    index `>= n` left out: padding there with $-\\infty$, those never exchange. 0, 1, 3, 5, 9,
    12, 16, 19, 28, 32 comparators for n = 1..10; $O(n \\log^2 n)$."""
    out = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        out.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(out)


def project_simplex(
    v: Float[Array, "... n"], mask: Bool[Array, "... n"], *, method: str = "auto"
) -> Float[Array, "... n"]:
    """$\\Pi_{\\Delta}(v) = \\arg\\min_{z \\in \\Delta} \\|z - v\\|_2$ over the last axis, with
    $\\Delta = \\{z \\ge 0, \\sum_j z_j = 1, z_j = 0 \\text{ where not } \\texttt{mask}_j\\}$.

    The projection is $(v - \\theta)^+$ on allowed entries with the threshold
    $\\theta = \\max_{k \\le m} (\\sum_{l\\le k} u_l - 1)/k$, $u$ the $m$ allowed entries in
    decreasing order (Held, Wolfe and Crowder; theory/model.md, *Policies*). The methods
    differ in how they order $u$:

    * `"network"` sorts by the comparators of `sorting_network` (an elementwise maximum and
      minimum each, on the entries as separate arrays), then takes the prefix sums and the
      largest candidate: $O(n \\log^2 n)$ elementwise operations with no sort, no gather and
      no reduction over the entries, so that they fuse into one loop whatever axis the batch
      is on (theory/discretisation.md, *Projection by a sorting network*);
    * `"pairwise"` forms, for every allowed entry $a$, the sum and count of the allowed
      entries $\\ge v_a$: $O(n^2)$ comparisons, the same maximum (a tie group's candidate is
      its last prefix);
    * `"sort"` calls `jnp.sort`.

    `"auto"` takes the network up to `NETWORK_MAX` (16) entries, the pairwise sums up to
    `PAIRWISE_MAX` (32) and the sort beyond: in the simulator's tick at 12 and 16 cells the
    network is 8-14% faster than the pairwise sums, at 20 cells XLA splits its loop and it
    is 3-11% slower (theory/discretisation.md). Rows with no allowed entry return zeros.
    """
    n = v.shape[-1]
    count = jnp.sum(mask, axis=-1, keepdims=True)
    if method == "auto":
        method = "network" if n <= NETWORK_MAX else "pairwise" if n <= PAIRWISE_MAX else "sort"
    if method == "network":
        # Disallowed entries are -inf: they sort last and enter no candidate (k <= m).
        col = [jnp.where(mask[..., j], v[..., j], -jnp.inf) for j in range(n)]
        for i, j in sorting_network(n):
            col[i], col[j] = jnp.maximum(col[i], col[j]), jnp.minimum(col[i], col[j])
        m = count[..., 0]
        css = col[0] - 1.0
        best, num, den = css, css, jnp.ones_like(css)
        for k in range(2, n + 1):
            css = css + col[k - 1]
            cand = css / k
            take = (k <= m) & (cand > best)
            best = jnp.where(take, cand, best)
            num = jnp.where(take, css, num)
            den = jnp.where(take, float(k), den)
        # theta = num / den is the best candidate to the bit. Written as a division (XLA
        # counts it expensive), it is computed once, not again inside every consumer.
        theta = (num / den)[..., None]
    elif method == "pairwise":
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
        raise ValueError(f"method = {method!r} is invalid: allowed {', '.join(map(repr, METHODS))}")
    return jnp.where(mask & (count > 0), jnp.maximum(v - theta, 0.0), 0.0)
