from __future__ import annotations

import jax.numpy as jnp

from .base import AbstractPolicy


class WeightedRandom(AbstractPolicy):
    """Weighted random routing: $x_{ij} \\propto k_j$ over allowed arcs, fixed in time.

    It ignores the scenario's `initial_routing`: $x_{ij}(t) = k_j/\\sum_{l \\in C^+(i)} k_l$
    for all $t$, history included.
    """

    cost: None = None

    @property
    def name(self) -> str:
        return "rand"

    def initial_routing(self, scn):
        w = jnp.where(scn.allowed, scn.replicas[None, :], 0.0)
        tot = jnp.sum(w, axis=-1, keepdims=True)
        return jnp.where(tot > 0, w / jnp.where(tot > 0, tot, 1.0), 0.0)

    def update(self, x, costs, step, allowed):
        return x
