"""Weighted random routing (Rand, seed App. B)."""

from __future__ import annotations

import jax.numpy as jnp

from .._scenario import proportional_routing
from .base import AbstractPolicy, replica_fractions


class WeightedRandom(AbstractPolicy):
    """Weighted random routing: $x_{ij} \\propto k_j(t)$ over allowed arcs (seed App. B).

    It ignores the scenario's `initial_routing`: $x_{ij}(t) = k_j(t)/\\sum_{l \\in C^+(i)}
    k_l(t)$, history included, where $k_j(t)$ follows the scenario's replica schedule (so
    Rand adapts to outages, as in the paper's DLB stack); constant without a schedule.
    The routing of the tick $[t_{k+1}, t_{k+2})$ uses the counts at its midpoint.
    """

    cost: None = None

    @property
    def name(self) -> str:
        return "rand"

    def initial_routing(self, scn, aux=None):
        return proportional_routing(scn.allowed, scn.replicas, jnp)

    def update(self, scn, setup, state, obs, aux):
        t = obs.t + 0.5 * setup.h
        k = replica_fractions(scn, t)
        x = proportional_routing(scn.allowed, k * scn.replicas, jnp).astype(state.dtype)
        return x, x
