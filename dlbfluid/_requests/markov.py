"""`markov` cells: the density-dependent birth-death process of the fluid model."""

from __future__ import annotations

import dataclasses

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
    - `frac`: `(n,)` the replica fraction $c_j$ in force (set by `refresh` every tick).
    - `speed`: `(n,)` the service speed $1/s_j$ in force (likewise).
    """

    origin: Float[Array, "n slots"]
    count: Int[Array, " n"]
    frac: Float[Array, " n"]
    speed: Float[Array, " n"]


class MarkovCells(AbstractCells):
    """Cells whose completions come at the fluid model's rate: with $N_j$ requests present
    at scale $k$, cell $j$ completes at rate $k\\,\\mu_j(N_j/k)$ (`rates`, with $\\mu_j$ the
    scenario's `ServiceModel.rate`), and every present request is equally likely to be
    the one that leaves (processor sharing). At $k\\to\\infty$, $N_j/k$ follows the fluid
    ODE (Kurtz; theory/requests.md, *Fluid limit*).

    **Replica schedule.** With a fraction $c_j(t)$ of its replicas running, the cell
    completes at $kc_j\\,\\mu_j(N_j/(kc_j))$: the fluid's scaled rate $c\\mu(N/c)$
    (`scaled_rate`; theory/evaluation.md §2) at scale $k$, so that the fluid limit still
    holds. $c_j$ is the one of the tick (`refresh`); requests above the shrunk buffer
    $\\lfloor kc_jB_j\\rfloor$ are dropped at the tick's start, as the fluid drops its excess.
    A service schedule's slowdown $s_j$ divides the rate (the fluid's
    $c\\mu(N/c)/s$), also at the tick's value.

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
        ones = jnp.ones(n, self.scale.dtype)  # (all replicas running, at full speed)
        return MarkovState(jnp.zeros((n, self.slots), dtype), count, ones, ones), over

    def refresh(self, state, frac, speed, cap):
        # The last requests of a cell's packed slots leave: the origins are exchangeable
        # for the count process (every present request is equally likely to complete).
        keep = jnp.where(jnp.isfinite(cap), jnp.minimum(state.count, cap), state.count)
        keep = keep.astype(jnp.int32)
        dt = state.frac.dtype
        new = MarkovState(state.origin, keep, frac.astype(dt), speed.astype(dt))
        return new, state.count - keep

    def count(self, state):
        return state.count

    def _fluid_rate(self, state):
        """$\\mu_j(N_j/(kc_j))$."""
        return self.service.rate(state.count.astype(self.scale.dtype) / (self.scale * state.frac))

    def rates(self, state):
        return self.scale * state.frac * state.speed * self._fluid_rate(state)

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
        count = state.count.at[j].add(do.astype(jnp.int32))
        return dataclasses.replace(state, origin=new_origin, count=count), ok & full

    def complete(self, state, j, u, t, ok):
        c = state.count[j]
        do = ok & (c > 0)
        r = jnp.clip(jnp.floor(u * c).astype(jnp.int32), 0, jnp.maximum(c - 1, 0))
        last = jnp.maximum(c - 1, 0)
        # One gather for both reads: the write below depends on it, so it stays in place.
        leaving, moved = state.origin[j, jnp.stack([r, last])]
        new_origin = state.origin.at[j, jnp.where(do, r, self.slots)].set(moved, mode="drop")
        count = state.count.at[j].add(-do.astype(jnp.int32))
        return dataclasses.replace(state, origin=new_origin, count=count), leaving, ok
