"""Service models: processing rate mu(N), serving latency l(N) and their derivatives.

Two models, selected per cell by an integer code so that cells of both kinds batch
together in one array program (theory/service.md):

* `MM1` (code 0): $\\mu(N) = \\bar\\mu N/(1+N)$, $\\ell(N) = (1+N)/\\bar\\mu$.
* `SOFTPLUS` (code 1): $\\ell(N) = L_0 + \\beta s\\,\\mathrm{sp}((N-N_0)/s)$ with
  $\\beta = 1/\\bar\\mu$ and $\\mu(N) = N/\\ell(N)$ (theory-notes §7).

Every function here is elementwise over cells and is written so that both branches of
the model selection are finite for every input (the `jnp.where` gradient rule).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MM1 = 0
SOFTPLUS = 1


@jax.custom_jvp
def softplus_sigmoid(u):
    """$(\\mathrm{sp}(u), \\mathrm{sp}(-u), \\sigma(u), \\sigma(-u))$ from one exponential.

    With $e = e^{-|u|} \\in (0, 1]$: $\\mathrm{sp}(\\pm u) = \\max(\\pm u, 0) + \\ln(1 + e)$
    and $\\sigma(\\pm u)$ is $1/(1+e)$ or $e/(1+e)$ by the sign of $\\pm u$; every term is
    free of cancellation. float64 exponentials and logarithms are the costliest
    elementwise operations of the solvers on CPU, and `jax.nn.softplus`/`jax.nn.sigmoid`
    of $\\pm u$ would take four exponentials and two logarithms. The derivative is given
    exactly ($\\mathrm{sp}' = \\sigma$, $\\sigma'(u) = \\sigma(u)\\sigma(-u)$), also at $u = 0$.
    """
    e = jnp.exp(-jnp.abs(u))
    l1p = jnp.log1p(e)
    r = 1.0 / (1.0 + e)
    pos = u >= 0
    return (
        jnp.maximum(u, 0.0) + l1p,
        jnp.maximum(-u, 0.0) + l1p,
        jnp.where(pos, r, e * r),
        jnp.where(pos, e * r, r),
    )


@softplus_sigmoid.defjvp
def _softplus_sigmoid_jvp(primals, tangents):
    (u,), (du,) = primals, tangents
    sp, sm, gp, gm = softplus_sigmoid(u)
    dg = gp * gm * du  # sigma' = sigma(u) sigma(-u) = e/(1+e)^2, no cancellation
    return (sp, sm, gp, gm), (gp * du, -gm * du, dg, -dg)


MODEL_CODES = {"mm1": MM1, "softplus": SOFTPLUS}


class ServiceModel(eqx.Module):
    """Per-cell service parameters, stored as arrays of shape `(n,)`.

    **Fields:**
    - `model`: integer code per cell, `0` = M/M/1, `1` = softplus.
    - `capacity`: $\\bar\\mu_j$, the supremum of the processing rate (requests/s).
    - `base_latency`: $L_0$ (softplus only; 1 for M/M/1 cells, unused).
    - `knee`: $N_0$ (softplus only; 0 for M/M/1 cells, unused).
    - `width`: $s$ (softplus only; 1 for M/M/1 cells, unused).
    """

    model: Int[Array, " n"]
    capacity: Float[Array, " n"]
    base_latency: Float[Array, " n"]
    knee: Float[Array, " n"]
    width: Float[Array, " n"]

    def __check_init__(self):
        shapes = {
            f: jnp.shape(getattr(self, f))
            for f in ("model", "capacity", "base_latency", "knee", "width")
        }
        if len(set(shapes.values())) != 1:
            raise ValueError(f"ServiceModel fields must share one shape, got {shapes}")

    # --- the two models, each finite for every N >= 0 -------------------------------

    def _softplus_parts(self, N):
        beta = 1.0 / self.capacity
        s = self.width
        u = (N - self.knee) / s
        sp_u, sp_m, sg_u, sg_m = softplus_sigmoid(u)
        ell = self.base_latency + beta * s * sp_u
        # q = ell - N ell' computed without cancellation (theory/service.md, eq. q):
        # q = L0 - beta N0 sigma(u) + beta s h(u),  h(u) = sp(u) - u sigma(u)
        #   = a0 + beta N0 sigma(-u) + beta s h(u)  for u > 0.
        pos = u > 0
        a0 = self.base_latency - beta * self.knee
        head = jnp.where(
            pos,
            a0 + beta * self.knee * sg_m,
            self.base_latency - beta * self.knee * sg_u,
        )
        h = jnp.where(pos, sp_m + u * sg_m, sp_u - u * sg_u)
        q = head + beta * s * h
        return ell, q

    def latency(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Serving latency $\\ell_j(N_j)$ (seconds)."""
        N = jnp.maximum(N, 0.0)
        ell_sp, _ = self._softplus_parts(N)
        ell_mm1 = (1.0 + N) / self.capacity
        return jnp.where(self.model == SOFTPLUS, ell_sp, ell_mm1)

    def rate(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Processing rate $\\mu_j(N_j) = N_j/\\ell_j(N_j)$ (requests/s); $\\mu_j(0)=0$."""
        N = jnp.maximum(N, 0.0)
        ell_sp, _ = self._softplus_parts(N)
        mu_sp = N / ell_sp
        mu_mm1 = self.capacity * N / (1.0 + N)
        return jnp.where(self.model == SOFTPLUS, mu_sp, mu_mm1)

    def rate_prime(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Marginal processing rate $\\mu_j'(N_j) = q_j/\\ell_j^2$, $q = \\ell - N\\ell'$."""
        N = jnp.maximum(N, 0.0)
        ell_sp, q = self._softplus_parts(N)
        d_sp = q / ell_sp**2
        d_mm1 = self.capacity / (1.0 + N) ** 2
        return jnp.where(self.model == SOFTPLUS, d_sp, d_mm1)

    def inv_rate_prime(self, N: Float[Array, "... n"]) -> Float[Array, "... n"]:
        """Gradient cost $1/\\mu_j'(N_j) = \\ell_j^2/q_j$, evaluated without cancellation."""
        N = jnp.maximum(N, 0.0)
        ell_sp, q = self._softplus_parts(N)
        f_sp = ell_sp**2 / q
        f_mm1 = (1.0 + N) ** 2 / self.capacity
        return jnp.where(self.model == SOFTPLUS, f_sp, f_mm1)

    def inverse_rate(self, z: Float[Array, "... n"], *, iters: int = 100) -> Float[Array, "... n"]:
        """$\\mu_j^{-1}(z_j)$ for $0 \\le z_j < \\bar\\mu_j$; $+\\infty$ for $z_j \\ge \\bar\\mu_j$.

        M/M/1 cells use the closed form $z/(\\bar\\mu - z)$. Softplus cells solve
        $\\mu(N) = z$ by bisection on a bracket grown geometrically, then polish with
        safeguarded Newton steps (theory-notes §7, *Inverse*).
        """
        cap = self.capacity
        inside = z < cap
        zc = jnp.clip(z, 0.0, jnp.where(inside, z, 0.5 * cap))
        n_mm1 = zc / (cap - zc)
        # Softplus: mu(N) >= N/(a0' + beta N) style lower bounds are model-specific, so
        # bracket by doubling from the M/M/1-like guess, then bisect.
        beta = 1.0 / cap
        lat_hi = (
            jnp.maximum(self.base_latency, 1e-300) + beta * jnp.abs(self.knee) + beta * self.width
        )
        hi0 = jnp.maximum(zc * lat_hi, 1.0)

        def grow(_, hi):
            return jnp.where(self.rate(hi) < zc, 2.0 * hi, hi)

        hi = jax.lax.fori_loop(0, 200, grow, hi0)
        lo = jnp.zeros_like(hi)

        def bisect(_, lohi):
            lo, hi = lohi
            mid = 0.5 * (lo + hi)
            below = self.rate(mid) < zc
            return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

        lo, hi = jax.lax.fori_loop(0, iters, bisect, (lo, hi))
        N = 0.5 * (lo + hi)

        def newton(_, N):
            step = (self.rate(N) - zc) / self.rate_prime(N)
            cand = N - step
            return jnp.where((cand >= lo) & (cand <= hi), cand, N)

        N = jax.lax.fori_loop(0, 3, newton, N)
        n_sp = N
        out = jnp.where(self.model == SOFTPLUS, n_sp, n_mm1)
        return jnp.where(inside, out, jnp.inf)
