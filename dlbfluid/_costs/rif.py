"""The RIF cost: requests in flight per replica (seed §3.2.3)."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from .._shapes import like
from .base import AbstractCost


class RIF(AbstractCost):
    """$f_j(N) = N/k_j$, $g_{ij} = 0$: equilibria equalise the requests in flight per
    replica (weighted least connections). Potential $p_j = \\frac{1}{k_j}\\int_0^{N} n\\mu_j'$
    (`ServiceModel.rif_potential`)."""

    name: ClassVar[str] = "rif"
    short: ClassVar[str] = "rif"

    def destination(self, scn, N):
        return N / like(scn.replicas, N)

    def arc(self, scn):
        return jnp.zeros_like(scn.latency)

    def slowed(self, f, s):
        # (requests per replica: a slower cell holds more of them, but the count is the count)
        return f

    def potential(self, scn, z, N):
        return scn.service.rif_potential(z, N) / like(scn.replicas, N)
