"""The latency cost: serving latency plus the network round trip (seed §3.2.3)."""

from __future__ import annotations

from typing import ClassVar

from .base import AbstractCost


class Latency(AbstractCost):
    """$f_j(N) = \\ell_j(N)$, $g_{ij} = 2\\tau_{ij}$: equilibria are Wardrop equilibria of the
    routing game. Potential $p_j = \\int_0^N \\ell_j\\mu_j'$, the Beckmann potential
    (`ServiceModel.latency_potential`)."""

    name: ClassVar[str] = "latency"
    short: ClassVar[str] = "lat"

    def destination(self, scn, N):
        return scn.service.latency(N)

    def potential(self, scn, z, N):
        return scn.service.latency_potential(z, N)
