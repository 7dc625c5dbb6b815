"""The generator's random streams: uniforms keyed by `(seed, index, stream, trial, block)`
alone (counter-based threefry keys folded in), so that scenario `i` of seed `s` is the same
in any batch, in any run, and a resumed sweep regenerates exactly what it lost.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

_BLOCK = 64


@jax.jit
def _uniform_blocks(seed, rows):
    """Row `r` of the result holds 64 uniforms keyed by `(seed, *rows[r])` only.

    `rows[r] = (index, stream, trial, block)`. Uniforms are multiples of $2^{-52}$ shifted
    by $2^{-53}$, so they lie in the open interval (0, 1) and every transform below
    (logarithm, normal quantile) is finite.
    """

    def one(row):
        key = jr.key(seed, impl="threefry2x32")
        for q in range(4):
            key = jr.fold_in(key, row[q])
        return jr.uniform(key, (_BLOCK,), dtype=jnp.float64) + 2.0**-53

    return jax.vmap(one)(rows)


def _uniforms(seed: int, indices: np.ndarray, width: int, *, stream: int, trial: int = 0):
    """`(B, width)` uniforms, row `b` a function of `(seed, indices[b], stream, trial)`.

    Drawn in blocks of 64 per row; the number of rows is padded to a power of two so that
    batches of any size share a few compiled shapes.
    """
    nb = -(-width // _BLOCK)
    B = indices.shape[0]
    rows = np.zeros((B, nb, 4), dtype=np.uint32)
    rows[:, :, 0] = np.asarray(indices, dtype=np.uint32)[:, None]
    rows[:, :, 1] = stream
    rows[:, :, 2] = trial
    rows[:, :, 3] = np.arange(nb, dtype=np.uint32)[None, :]
    flat = rows.reshape(B * nb, 4)
    padded = max(4096, 1 << (flat.shape[0] - 1).bit_length())
    flat = np.concatenate([flat, np.zeros((padded - flat.shape[0], 4), dtype=np.uint32)])
    u = np.asarray(_uniform_blocks(seed, jnp.asarray(flat)))[: B * nb]
    return u.reshape(B, nb * _BLOCK)[:, :width]
