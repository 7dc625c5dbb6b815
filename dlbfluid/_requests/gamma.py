"""Gamma variates for a block of requests (theory/requests.md, *Token draws*).

`jax.random.gamma` runs one rejection loop per variate, each round splitting the
variate's own key; for the token counts of a chunk of requests (hundreds per lane, vmapped
over lanes) that is a third of the admission engine's time. `gamma` draws the same law by
Marsaglia and Tsang's rejection method, vectorised: every variate gets `rounds` proposals
drawn in one block, the first accepted one is kept, and the few variates with none accepted
redraw together in a loop (so the law is exact, not truncated: a proposal's acceptance does
not depend on the others).

For shape $\\alpha \\ge 1$, with $d = \\alpha - 1/3$, $c = 1/\\sqrt{9d}$, $x \\sim N(0, 1)$,
$u \\sim U(0, 1)$ and $v = (1 + cx)^3$, the proposal $dv$ is accepted when $v > 0$ and
$\\log u < x^2/2 + d - dv + d\\log v$; accepted values are $\\mathrm{Gamma}(\\alpha, 1)$
exactly, and a proposal is accepted with probability above 0.95. For $\\alpha < 1$ the
variate is $G_{\\alpha+1}U^{1/\\alpha}$ with $G_{\\alpha+1} \\sim \\mathrm{Gamma}(\\alpha+1, 1)$.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr


def _proposal(d, c, x, u):
    """`(value, accepted)` of Marsaglia-Tsang proposals from normals `x` and uniforms `u`."""
    v = (1.0 + c * x) ** 3
    pos = v > 0
    logv = jnp.log(jnp.where(pos, v, 1.0))
    ok = pos & (jnp.log(u) < 0.5 * x * x + d - d * v + d * logv)
    return d * v, ok


def gamma(key, shape, n: int, dtype, rounds: int = 2):
    """`(n,)` independent $\\mathrm{Gamma}(\\alpha, 1)$ variates, $\\alpha$ = `shape` (a
    positive scalar), by vectorised Marsaglia-Tsang rejection (module docstring): `rounds`
    proposals each, the first accepted kept, the rest redrawn in a loop until accepted."""
    a = jnp.asarray(shape, dtype)
    boost = a < 1.0
    ab = jnp.where(boost, a + 1.0, a)
    d = ab - 1.0 / 3.0
    c = 1.0 / jnp.sqrt(9.0 * d)
    kx, ku, kb, kl = jr.split(key, 4)
    value, ok = _proposal(
        d, c, jr.normal(kx, (n, rounds), dtype), jr.uniform(ku, (n, rounds), dtype)
    )
    first = jnp.argmax(ok, axis=-1)
    got = jnp.any(ok, axis=-1)
    val = jnp.take_along_axis(value, first[:, None], axis=-1)[:, 0]

    def more(s):
        return jnp.any(~s[1])

    def redraw(s):
        val, got, k = s
        k, k1, k2 = jr.split(k, 3)
        v, o = _proposal(d, c, jr.normal(k1, (n,), dtype), jr.uniform(k2, (n,), dtype))
        return jnp.where(got, val, v), got | o, k

    val, _, _ = jax.lax.while_loop(more, redraw, (val, got, kl))
    u = jr.uniform(kb, (n,), dtype)
    return jnp.where(boost, val * u ** (1.0 / jnp.where(boost, a, 1.0)), val)
