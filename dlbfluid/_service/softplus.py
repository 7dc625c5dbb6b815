"""The softplus service model (theory/service.md, *Softplus*; seed §3.3).

$$\\ell(N) = L_0 + \\beta s\\,\\mathrm{sp}\\Big(\\frac{N - N_0}{s}\\Big)
= a_0 + \\beta N + \\beta s\\,\\mathrm{sp}\\Big(\\frac{N_0 - N}{s}\\Big),\\qquad
\\beta = 1/\\bar\\mu,\\ a_0 = L_0 - \\beta N_0 > 0,$$

flat at $L_0$ below the knee $N_0$ and linear with slope $\\beta$ above it; $\\mu = N/\\ell$.
Every formula of the law lives here, each written without cancellation: the latency,
$q = \\ell - N\\ell'$, the inverse $\\mu^{-1}$, the flow balance of the equilibrium solver
and the potentials of the latency and RIF costs.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._elementary import exp_neg, log1p_unit
from .._errors import ScenarioError
from .._shapes import lead
from .base import AbstractServiceModel, Params, number, positive


@jax.custom_jvp
def softplus_sigmoid(u):
    """$(\\mathrm{sp}(u), \\mathrm{sp}(-u), \\sigma(u), \\sigma(-u))$ from one exponential.

    With $e = e^{-|u|} \\in (0, 1]$: $\\mathrm{sp}(\\pm u) = \\max(\\pm u, 0) + \\ln(1 + e)$
    and $\\sigma(\\pm u)$ is $1/(1+e)$ or $e/(1+e)$ by the sign of $\\pm u$; every term is
    free of cancellation. Exponentials and logarithms are the costliest elementwise
    operations of the solvers on CPU, and `jax.nn.softplus`/`jax.nn.sigmoid` of $\\pm u$
    would take four exponentials and two logarithms; the one of each taken here is plain
    arithmetic (`exp_neg`, `log1p_unit` in `dlbfluid/_elementary.py`, within two units in
    the last place), which XLA's CPU loops vectorise where library calls stay scalar. The
    derivative is given exactly ($\\mathrm{sp}' = \\sigma$,
    $\\sigma'(u) = \\sigma(u)\\sigma(-u)$), also at $u = 0$.
    """
    e = exp_neg(-jnp.abs(u))
    l1p = log1p_unit(e)
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


def latency_asymptotic(a0, beta, knee, width, N):
    """$\\ell(N) = a_0 + \\beta(N + s\\,\\mathrm{sp}((N_0 - N)/s))$: the same law in the
    coordinates $\\theta = (a_0, \\beta, N_0, s)$ of the latency fits (theory/estimation.md),
    in which $\\ell > a_0 > 0$ for any $\\theta > 0$."""
    sp_v, _, _, _ = softplus_sigmoid((knee - N) / width)
    return a0 + beta * (N + width * sp_v)


# Gauss-Legendre rule for the potentials: 16 nodes on each of 8 panels graded towards the
# knee, with edges at N0 + s * _GL_EDGES (then clipped to the integration window). The
# integrand is analytic with poles at distance pi (in units of s) from the real axis, and
# deviates from its asymptotes only within a few s of the knee: graded panels reach
# rounding level (8e-16 relative, against 64 x 32 uniform panels) where 8 uniform panels
# of 16 nodes, the same work, stopped at 2e-10.
_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)
_GL_EDGES = np.array([-40.0, -20.0, -10.0, -5.0, 0.0, 5.0, 10.0, 20.0, 40.0])


def _gl_integral(fun, knee, width, a, b):
    """$\\int_a^b$ `fun` by composite Gauss-Legendre on panels graded towards `knee`
    (elementwise over cells; $[a, b] \\subseteq$ knee $\\pm 40$ width)."""
    knee, width, a, b = jnp.broadcast_arrays(knee, width, a, b)
    grade = lead(jnp.asarray(_GL_EDGES), knee.ndim + 1)
    edges = jnp.clip(knee[..., None] + width[..., None] * grade, a[..., None], b[..., None])
    lo, hi = edges[..., :-1], edges[..., 1:]
    mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
    nodes = mid[..., None] + half[..., None] * lead(jnp.asarray(_GL_X), mid.ndim + 1)
    vals = fun(nodes)
    return jnp.sum(jnp.sum(vals * lead(jnp.asarray(_GL_W), nodes.ndim), axis=-1) * half, axis=-1)


class Softplus(AbstractServiceModel):
    """The softplus law; parameters `capacity` $\\bar\\mu$, `base_latency` $L_0$, `knee`
    $N_0$ and `width` $s$, with $a_0 = L_0 - N_0/\\bar\\mu > 0$ (Assumptions 1 and 3).

    $q = \\ell - N\\ell'$ is evaluated as $L_0 - \\beta N_0\\sigma(u) + \\beta s\\,h(u)$ with
    $h(u) = \\mathrm{sp}(u) - u\\sigma(u)$, switched to $a_0 + \\beta N_0\\sigma(-u) + \\beta s
    (\\mathrm{sp}(-u) + u\\sigma(-u))$ for $u > 0$ (theory/service.md, eq. q), so that
    $1/\\mu' = \\ell^2/q$ keeps its relative accuracy deep in the linear regime.
    """

    name: ClassVar[str] = "softplus"
    parameters: ClassVar[tuple[str, ...]] = ("capacity", "base_latency", "knee", "width")
    defaults: ClassVar[dict[str, float]] = {
        "capacity": 1.0,
        "base_latency": 1.0,
        "knee": 0.0,
        "width": 1.0,
    }

    def _parts(self, p: Params, N):
        """$(\\ell, q)$, each without cancellation."""
        beta = 1.0 / p["capacity"]
        s = p["width"]
        u = (N - p["knee"]) / s
        sp_u, sp_m, sg_u, sg_m = softplus_sigmoid(u)
        ell = p["base_latency"] + beta * s * sp_u
        pos = u > 0
        a0 = p["base_latency"] - beta * p["knee"]
        head = jnp.where(
            pos,
            a0 + beta * p["knee"] * sg_m,
            p["base_latency"] - beta * p["knee"] * sg_u,
        )
        h = jnp.where(pos, sp_m + u * sg_m, sp_u - u * sg_u)
        return ell, head + beta * s * h

    def latency(self, p: Params, N):
        return self._parts(p, N)[0]

    def rate(self, p: Params, N):
        return N / self._parts(p, N)[0]

    def latency_slope(self, p: Params, N):
        _, _, sg_u, _ = softplus_sigmoid((N - p["knee"]) / p["width"])
        return sg_u / p["capacity"]

    def q(self, p: Params, N):
        return self._parts(p, N)[1]

    def rate_prime(self, p: Params, N):
        ell, q = self._parts(p, N)
        return q / ell**2

    def inv_rate_prime(self, p: Params, N):
        ell, q = self._parts(p, N)
        return ell**2 / q

    def inverse_rate(self, p: Params, z, guess=None, *, max_iter: int = 60):
        """Newton on $h(N) = N(\\bar\\mu - z)/\\bar\\mu - z\\,[a_0 + \\beta s\\,
        \\mathrm{sp}((N_0-N)/s)]$, which is $N - z\\ell(N)$ written without cancellation.
        $h$ is concave and increasing, so Newton steps from any point left of the root
        increase monotonically to it; the start is the lower bound $\\max(zL_0,\\ z a_0/(1 -
        z\\beta))$ (from $\\ell(N) \\ge \\max(L_0, a_0+\\beta N)$) or a warm `guess` above it (a
        step from the right lands left of the root). Iterates until every relative step is
        below $10^{-13}$ (theory/equilibria.md §3.3)."""
        cap = p["capacity"]
        inside = z < cap
        zs = jnp.where(inside, jnp.maximum(z, 0.0), 0.0)
        slack = (cap - zs) / cap
        beta = 1.0 / cap
        L0, N0, s = p["base_latency"], p["knee"], p["width"]
        a0 = L0 - beta * N0
        lb = jnp.maximum(zs * L0, zs * a0 / slack)
        if guess is None:
            N = lb
        else:
            g = jnp.where(jnp.isfinite(guess), guess, 0.0)
            N = jnp.maximum(g, lb)

        def step(N):
            sp_v, _, sg_v, _ = softplus_sigmoid((N0 - N) / s)
            h = N * slack - zs * (a0 + beta * s * sp_v)
            hp = slack + zs * beta * sg_v
            return jnp.maximum(N - h / hp, lb)

        def cond(c):
            k, N, Nn = c
            return (k < max_iter) & jnp.any(jnp.abs(Nn - N) > 1e-13 * Nn)

        def body(c):
            k, _, Nn = c
            return k + 1, Nn, step(Nn)

        _, _, N = jax.lax.while_loop(cond, body, (jnp.asarray(0), N, step(N)))
        return jnp.where(inside, N, jnp.inf)

    def balance(self, p: Params, N, z):
        # h = N (mubar - z)/mubar - z r(N) with r = l - beta N = a0 + beta s sp((N0 - N)/s),
        # nearly affine in N: no cancellation between N and z l(N) (theory/equilibria.md
        # §3.2).
        cap = p["capacity"]
        beta = 1.0 / cap
        v = (p["knee"] - N) / p["width"]
        a0 = p["base_latency"] - beta * p["knee"]
        sp_v, _, sg_v, _ = softplus_sigmoid(v)
        rest = a0 + beta * p["width"] * sp_v
        drest = -beta * sg_v
        ell = beta * N + rest
        return N * (cap - z) / cap - z * rest, (cap - z) / cap - z * drest, ell

    def _windows(self, p: Params, N):
        """Split $[0, N]$ at $N_0 \\mp 40s$: below, $\\ell \\equiv L_0$ (exact to $e^{-40}$);
        above, $\\ell = a_0 + \\beta n$; in between, graded Gauss-Legendre panels."""
        cap, L0, N0, s = p["capacity"], p["base_latency"], p["knee"], p["width"]
        beta = 1.0 / cap
        a0 = L0 - beta * N0
        a = jnp.clip(N0 - 40.0 * s, 0.0, N)
        b = jnp.clip(N0 + 40.0 * s, a, N)

        def ell_q(n):
            v = jnp.expand_dims
            L0_, N0_, s_, b_ = v(L0, -1), v(N0, -1), v(s, -1), v(beta, -1)
            while L0_.ndim < n.ndim:
                L0_, N0_, s_, b_ = v(L0_, -1), v(N0_, -1), v(s_, -1), v(b_, -1)
            u = (n - N0_) / s_
            sp_u, _, sg_u, _ = softplus_sigmoid(u)
            ell = L0_ + b_ * s_ * sp_u
            return ell, ell - n * b_ * sg_u

        return a, b, a0, beta, ell_q

    def latency_potential(self, p: Params, z, N):
        """$\\int_0^N \\ell\\mu' = \\int_0^N q/\\ell$: $a$ below the knee window, Gauss-Legendre
        across it, $(a_0/\\beta)\\ln\\frac{a_0+\\beta N}{a_0+\\beta b}$ above it."""
        a, b, a0, beta, ell_q = self._windows(p, N)

        def fun(n):
            ell, q = ell_q(n)
            return q / ell

        right = (a0 / beta) * jnp.log((a0 + beta * N) / (a0 + beta * b))
        return a + _gl_integral(fun, p["knee"], p["width"], a, b) + right

    def rif_potential(self, p: Params, z, N):
        """$\\int_0^N n\\mu' = \\int_0^N nq/\\ell^2$: $a^2/(2L_0)$ below the knee window,
        Gauss-Legendre across it, the closed form of $a_0 + \\beta n$ above it."""
        a, b, a0, beta, ell_q = self._windows(p, N)

        def fun(n):
            ell, q = ell_q(n)
            return n * q / ell**2

        left = a**2 / (2.0 * p["base_latency"])
        right = (a0 / beta**2) * (
            jnp.log((a0 + beta * N) / (a0 + beta * b)) + a0 / (a0 + beta * N) - a0 / (a0 + beta * b)
        )
        return left + _gl_integral(fun, p["knee"], p["width"], a, b) + right

    def perturb(self, p: Params, c) -> dict:
        # theta = (a0, beta, N0, s) -> c theta, back in stored fields: mubar/c, c N0, c s and
        # L0' = c a0 + c^2 beta N0 = c (L0 + (c - 1) N0/mubar), written so that c = 1 is exact.
        L0 = c * (p["base_latency"] + (c - 1.0) * p["knee"] / p["capacity"])
        return {
            "capacity": p["capacity"] / c,
            "base_latency": L0,
            "knee": c * p["knee"],
            "width": c * p["width"],
        }

    def parse(self, field: str, value: dict) -> dict[str, float]:
        unknown = set(value) - {"model", *self.parameters}
        if unknown:
            raise ScenarioError(
                f"{field} = {value!r} is invalid: unknown keys {sorted(unknown)} for model "
                f"'softplus'; allowed: {', '.join(self.parameters)}"
            )
        cap = positive(f"{field}.capacity", value.get("capacity"))
        L0 = positive(f"{field}.base_latency", value.get("base_latency"))
        knee = number(f"{field}.knee", value.get("knee"))
        width = positive(f"{field}.width", value.get("width"))
        a0 = L0 - knee / cap
        if a0 < 0:
            raise ScenarioError(
                f"{field}: a0 = base_latency - knee/capacity = {L0} - {knee}/{cap} = {a0:.6g} "
                "< 0: the processing rate mu(N) = N/l(N) overshoots the capacity and then "
                "falls, so it is not monotone (Assumption 1). Allowed: knee < base_latency * "
                "capacity."
            )
        if a0 <= 1e-12 * max(L0, 1.0):
            raise ScenarioError(
                f"{field}: a0 = base_latency - knee/capacity = {a0:.3g} (knee exactly at "
                "base_latency * capacity): the gradient cost 1/mu'(N) then grows exponentially "
                "and violates Assumption 3 (it overflows in floating point). Allowed: knee < "
                "base_latency * capacity."
            )
        return {"capacity": cap, "base_latency": L0, "knee": knee, "width": width}
