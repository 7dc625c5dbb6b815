"""The Newton systems of the equilibrium solver (theory/equilibria.md §3.1, *Newton system*).

Both stages solve their Newton systems through a Schur complement in the per-source
multipliers, a symmetric diagonally dominant M-matrix that is factored by GTH-style
(subtraction-free) elimination, so the solve keeps its accuracy when the interior-point
weights span many orders of magnitude.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array


def _mmatrix_factor(off, excess):
    """Factor $S = LU$ for a symmetric M-matrix given by its off-diagonal part `off`
    ($\\le 0$, zero diagonal) and its row sums `excess` $v_i = \\sum_k S_{ik} \\ge 0$.

    Gaussian elimination in the GTH form: every pivot is recomputed as the remaining
    off-diagonal mass plus the row excess, and the excesses are updated as sums of
    non-negative terms, so no step subtracts nearly equal numbers (theory/equilibria.md
    §3.1). No pivoting is needed: the matrix stays diagonally dominant. Returns the
    eliminated matrix (its strict upper part is $U$'s, its strict lower part holds the
    eliminated column entries, $L_{ik} = $ entry $/$ pivot) and the pivots.
    """
    n = excess.shape[-1]
    idx = jnp.arange(n)
    offdiag = idx[:, None] != idx[None, :]

    def elim(k, carry):
        A, v, piv = carry
        rem = idx > k
        p = v[k] + jnp.sum(jnp.where(rem, -A[k], 0.0))
        p = jnp.where(p > 0, p, 1.0)
        l = jnp.where(rem, A[:, k] / p, 0.0)
        upd = rem[:, None] & rem[None, :] & offdiag
        A = jnp.where(upd, A - l[:, None] * A[k][None, :], A)
        v = jnp.where(rem, v - l * v[k], v)
        return A, v, piv.at[k].set(p)

    A, _, piv = jax.lax.fori_loop(0, n, elim, (off, excess, jnp.ones_like(excess)))
    return A, piv


def _mmatrix_apply(A, piv, b):
    """Solve $Su = b$ with the factors of `_mmatrix_factor`; `b` is `(n,)` or `(n, k)`."""
    n = piv.shape[-1]
    vec = b.ndim == 1
    if vec:
        b = b[:, None]
    idx = jnp.arange(n)

    def fwd(k, r):
        l = jnp.where(idx > k, A[:, k] / piv[k], 0.0)
        return r - l[:, None] * r[k][None, :]

    rhs = jax.lax.fori_loop(0, n, fwd, b)

    def back(t, u):
        k = n - 1 - t
        rem = idx > k
        r = rhs[k] - jnp.sum(jnp.where(rem[:, None], A[k][:, None] * u, 0.0), axis=0)
        return u.at[k].set(r / piv[k])

    u = jax.lax.fori_loop(0, n, back, jnp.zeros_like(b))
    return u[:, 0] if vec else u


def _mmatrix_solve(off, excess, b):
    """Solve $Su = b$ for the M-matrix of `_mmatrix_factor` (`b` `(n,)` or `(n, k)`)."""
    return _mmatrix_apply(*_mmatrix_factor(off, excess), b)


class _Schur(eqx.Module):
    """The reduced Newton system of `_newton_direction`, factored once for several
    right-hand sides."""

    E: Array
    W: Array
    EW: Array
    A: Array
    piv: Array
    src: Array

    def solve(self, q, rp):
        """`(dy, dnu)` for the right-hand side `q` `(n, n)`, `rp` `(n,)`."""
        E, W, EW = self.E, self.W, self.EW
        Eq = E * q
        Q = jnp.sum(Eq, axis=0)
        rhs = jnp.where(self.src, -rp + jnp.sum(Eq, axis=1) - EW @ Q, 0.0)
        dnu = _mmatrix_apply(self.A, self.piv, rhs)
        w = W * (E.T @ dnu - Q)
        dy = E * (dnu[:, None] - w[None, :] - q)
        return dy, dnu


def _schur(E, P, src) -> _Schur:
    """Eliminate $\\Delta y$ and $\\Delta z$ from the Newton system of `_newton_direction`
    and factor the remaining M-matrix in the multipliers."""
    n = E.shape[-1]
    eye = jnp.eye(n, dtype=bool)
    f = jnp.sum(E, axis=0)
    W = 1.0 / (f + 1.0 / P)
    EW = E * W[None, :]
    # S's off-diagonal part as a sum of n outer products (n is static): XLA fuses it into
    # one elementwise pass, about 3x faster on CPU than its batched `dot` of tiny
    # matrices.
    off = -sum(EW[:, j][:, None] * E[:, j][None, :] for j in range(n))
    both = src[:, None] & src[None, :] & ~eye
    off = jnp.where(both, off, 0.0)
    excess = jnp.where(src, jnp.sum(EW / P[None, :], axis=1), 1.0)
    A, piv = _mmatrix_factor(off, excess)
    return _Schur(E=E, W=W, EW=EW, A=A, piv=piv, src=src)


def _newton_direction(E, q, rp, P, src):
    """Solve the linearised KKT system in the arc flows for `(dy, dnu)`:

    $P_j\\,\\Delta z_j - \\Delta\\nu_i + \\Delta y_{ij}/E_{ij} = -q_{ij}$ on arcs with $E_{ij} > 0$,
    $\\sum_j \\Delta y_{ij} = -r^p_i$, $\\Delta z_j = \\sum_i \\Delta y_{ij}$.

    Eliminating $w_j = P_j\\Delta z_j = W_j(\\sum_i E_{ij}\\Delta\\nu_i - \\sum_i E_{ij}q_{ij})$,
    $W_j = 1/(\\sum_i E_{ij} + 1/P_j)$, leaves $S\\Delta\\nu = \\text{rhs}$ with
    $S_{ik} = -\\sum_j E_{ij}W_jE_{kj}$ ($i \\ne k$) and row sums $\\sum_j E_{ij}W_j/P_j$
    (theory/equilibria.md §3.1). Rows of sources without demand are the identity.
    """
    return _schur(E, P, src).solve(q, rp)


def _step_to_boundary(v, dv, mask):
    """Largest $\\alpha$ with $v + \\alpha\\,dv \\ge 0$ on `mask` (inf if unbounded)."""
    r = jnp.where(mask & (dv < 0), -v / jnp.where(dv < 0, dv, -1.0), jnp.inf)
    return jnp.min(r)


def _step_to_boundary_inv(inv_v, dv, mask):
    """`_step_to_boundary` for $v > 0$ on `mask` given $1/v$: one reduction of the rates
    $-dv/v$ and one scalar division instead of a division per entry."""
    rate = jnp.max(jnp.where(mask, -dv * inv_v, 0.0))
    return jnp.where(rate > 0, 1.0 / jnp.where(rate > 0, rate, 1.0), jnp.inf)
