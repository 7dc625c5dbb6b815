"""The M/M/1 service model: $\\mu(N) = \\bar\\mu N/(1+N)$ (theory/service.md, *M/M/1*)."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from .base import AbstractServiceModel, Params


class MM1(AbstractServiceModel):
    """$\\mu(N) = \\bar\\mu N/(1+N)$, $\\ell(N) = (1+N)/\\bar\\mu$, $\\mu'(N) = \\bar\\mu/(1+N)^2$,
    $\\mu^{-1}(z) = z/(\\bar\\mu - z)$; one parameter, `capacity` $= \\bar\\mu$.

    Potentials (theory/equilibria.md §1.2): $\\int_0^N \\ell\\mu' = \\ln(1+N)$ and
    $\\int_0^N n\\mu' = \\bar\\mu\\ln(1+N) - z$ with $z = \\mu(N)$.
    """

    name: ClassVar[str] = "mm1"
    parameters: ClassVar[tuple[str, ...]] = ("capacity",)
    defaults: ClassVar[dict[str, float]] = {"capacity": 1.0}

    def latency(self, p: Params, N):
        return (1.0 + N) / p["capacity"]

    def rate(self, p: Params, N):
        return p["capacity"] * N / (1.0 + N)

    def latency_slope(self, p: Params, N):
        return jnp.broadcast_to(1.0 / p["capacity"], jnp.shape(N))

    def q(self, p: Params, N):
        return jnp.broadcast_to(1.0 / p["capacity"], jnp.shape(N))

    def rate_prime(self, p: Params, N):
        return p["capacity"] / (1.0 + N) ** 2

    def inv_rate_prime(self, p: Params, N):
        return (1.0 + N) ** 2 / p["capacity"]

    def inverse_rate(self, p: Params, z, guess=None):
        cap = p["capacity"]
        inside = z < cap
        zc = jnp.where(inside, jnp.maximum(z, 0.0), 0.0)
        return jnp.where(inside, zc / (cap - zc), jnp.inf)

    def balance(self, p: Params, N, z):
        # h = N - z (1 + N)/mubar = N (mubar - z)/mubar - z/mubar: affine in N, no
        # cancellation between N and z l(N).
        cap = p["capacity"]
        beta = 1.0 / cap
        return N * (cap - z) / cap - z * beta, (cap - z) / cap, beta * N + beta

    def latency_potential(self, p: Params, z, N):
        return jnp.log1p(N)

    def rif_potential(self, p: Params, z, N):
        return -z + p["capacity"] * jnp.log1p(N)
