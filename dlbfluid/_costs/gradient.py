"""The gradient cost: marginal latency of one more request (seed §3.2.3, §4)."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from .base import AbstractCost


class Gradient(AbstractCost):
    """$f_j(N) = 1/\\mu_j'(N)$, $g_{ij} = 2\\tau_{ij}$: equilibria minimise the mean
    end-to-end latency (social optimum). Potential $p_j = \\int_0^N f_j\\mu_j' = N_j$, so
    $\\Psi$ is $\\Lambda$ times the mean latency (theory/equilibria.md §1.2)."""

    name: ClassVar[str] = "gradient"
    short: ClassVar[str] = "grad"

    def destination(self, scn, N):
        return scn.service.inv_rate_prime(N)

    def potential(self, scn, z, N):
        return jnp.asarray(N)
