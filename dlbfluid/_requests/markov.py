"""`markov` cells: the density-dependent birth-death process of the fluid model."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._service import ServiceModel
from .cells import AbstractCells


class MarkovState(eqx.Module):
    """Requests present in `markov` cells.

    **Fields:**
    - `origin`: `(n, slots)` origins of the present requests, packed: the requests of cell
      `j` occupy slots `0 .. count[j] - 1` (a completion moves the last one into the hole).
    - `count`: `(n,)` requests present.
    """

    origin: Float[Array, "n slots"]
    count: Int[Array, " n"]


class MarkovCells(AbstractCells):
    """Cells whose completions come at the fluid model's rate: with $N_j$ requests present
    at scale $k$, cell $j$ completes at rate $k\\,\\mu_j(N_j/k)$ (`rates`, with $\\mu_j$ the
    scenario's `ServiceModel.rate`), and every present request is equally likely to be
    the one that leaves (processor sharing). At $k\\to\\infty$, $N_j/k$ follows the fluid
    ODE (Kurtz; theory/requests.md, *Fluid limit*).

    **Fields:** `service` (the scenario's true service table), `scale` ($k$, a scalar
    array), `slots` (static: requests a cell can hold; more is an overflow).
    """

    service: ServiceModel
    scale: Float[Array, ""]
    slots: int = eqx.field(static=True)

    def init(self, counts, dtype, key):
        n = counts.shape[0]
        over = jnp.any(counts > self.slots)
        count = jnp.minimum(counts, self.slots).astype(jnp.int32)
        return MarkovState(jnp.zeros((n, self.slots), dtype), count), over

    def refresh(self, state):
        return state

    def count(self, state):
        return state.count

    def _fluid_rate(self, state):
        return self.service.rate(state.count.astype(self.scale.dtype) / self.scale)

    def rates(self, state):
        return self.scale * self._fluid_rate(state)

    def next_time(self, state):
        return jnp.full(self.service.capacity.shape, jnp.inf, self.scale.dtype)

    def utilisation(self, state):
        return self._fluid_rate(state) / self.service.capacity

    def admit(self, state, j, origin, t, ok):
        c = state.count[j]
        full = c >= self.slots
        do = ok & ~full
        # (an index past the slots drops the write: no read of the old value, so that the
        # update stays in place inside the loop)
        slot = jnp.where(do, c, self.slots)
        new_origin = state.origin.at[j, slot].set(origin, mode="drop")
        return MarkovState(new_origin, state.count.at[j].add(do.astype(jnp.int32))), ok & full

    def complete(self, state, j, u, t, ok):
        c = state.count[j]
        do = ok & (c > 0)
        r = jnp.clip(jnp.floor(u * c).astype(jnp.int32), 0, jnp.maximum(c - 1, 0))
        last = jnp.maximum(c - 1, 0)
        # One gather for both reads: the write below depends on it, so it stays in place.
        leaving, moved = state.origin[j, jnp.stack([r, last])]
        new_origin = state.origin.at[j, jnp.where(do, r, self.slots)].set(moved, mode="drop")
        count = state.count.at[j].add(-do.astype(jnp.int32))
        return MarkovState(new_origin, count), leaving, ok
