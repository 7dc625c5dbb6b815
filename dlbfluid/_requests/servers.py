"""`servers` cells: exponential FIFO servers (the M/M/1 cell of the `servers` mode)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .cells import AbstractCells


def running(servers: Int[Array, " n"], frac: Float[Array, " n"]) -> Int[Array, " n"]:
    """Servers running at replica fraction $c_j$: $\\max(1, \\mathrm{round}(c_jS_j))$ of
    the $S_j$ = `servers` (0 for a padded cell), the lowest indices."""
    a = jnp.round(servers.astype(frac.dtype) * frac).astype(jnp.int32)
    return jnp.where(servers > 0, jnp.clip(a, 1, servers), 0)


class ServersState(eqx.Module):
    """Requests queued at the servers of every cell.

    **Fields:**
    - `origin`: `(n, S, Q)` a ring buffer of origins per server, FIFO from `head`.
    - `head`, `size`: `(n, S)` the ring's first slot and length (the server's requests,
      the one in service included).
    - `active`: `(n,)` the servers running (accepting requests) in the current tick.
    """

    origin: Float[Array, "n S Q"]
    head: Int[Array, "n S"]
    size: Int[Array, "n S"]
    active: Int[Array, " n"]


class FifoServers(AbstractCells):
    """Cell $j$ as `servers[j]` identical servers, each serving its own FIFO queue one
    request at a time with exponential service times of rate `rate[j]`.

    **Leaf routing:** a request that reaches cell $j$ joins the server with the fewest
    requests (queued plus in service), the lowest index on ties (join the shortest queue).
    A cell of one server is the M/M/1 queue: the sojourn time at arrival rate $\\lambda$
    is exponential of rate $\\mu - \\lambda$ (theory/requests.md, *Servers*).

    **Replica schedule** (`running`): in a tick with replica fraction $c_j$ the servers
    $0 .. a_j - 1$ run, $a_j = \\max(1, \\mathrm{round}(c_j\\,$`servers[j]`$))$; leaf
    routing only sees them. A server that goes away drains: it takes no new request but
    serves those it holds, so nothing is lost or moved; once drained, the cell serves at
    most $a_j$ `rate[j]`. The utilisation is busy servers over running ones, capped at 1.

    **Fields:** `rate` (`(n,)` per-server service rate), `servers` (`(n,)` server count,
    0 for padded cells), `max_servers` and `queue` (static: the server axis and each
    server's ring length; a request that finds its server's ring full is an overflow).
    """

    rate: Float[Array, " n"]
    servers: Int[Array, " n"]
    max_servers: int = eqx.field(static=True)
    queue: int = eqx.field(static=True)

    def init(self, counts, dtype, key):
        n, S = counts.shape[0], self.max_servers
        k = jnp.maximum(self.servers, 1)[:, None]
        s = jnp.arange(S)[None, :]
        # Round-robin: the first `counts % servers` servers hold one request more.
        size = jnp.where(s < self.servers[:, None], counts[:, None] // k, 0)
        size = size + ((s < counts[:, None] % k) & (s < self.servers[:, None]))
        over = jnp.any(size > self.queue) | jnp.any((counts > 0) & (self.servers == 0))
        size = jnp.minimum(size, self.queue).astype(jnp.int32)
        zeros = jnp.zeros((n, S), jnp.int32)
        state = ServersState(jnp.zeros((n, S, self.queue), dtype), zeros, size, self.servers)
        return state, over

    def refresh(self, state, frac, cap):
        active = running(self.servers, frac)
        return dataclasses.replace(state, active=active), jnp.zeros_like(active)

    def count(self, state):
        return jnp.sum(state.size, axis=-1)

    def _busy(self, state):
        return jnp.sum(state.size > 0, axis=-1)

    def rates(self, state):
        return self.rate * self._busy(state).astype(self.rate.dtype)

    def next_time(self, state):
        return jnp.full(self.rate.shape, jnp.inf, self.rate.dtype)

    def utilisation(self, state):
        busy = self._busy(state).astype(self.rate.dtype)
        u = jnp.minimum(busy / jnp.maximum(state.active, 1), 1.0)
        return jnp.where(self.servers > 0, u, 0.0)

    def admit(self, state, j, origin, t, ok):
        sizes = state.size[j]
        valid = jnp.arange(self.max_servers) < state.active[j]
        s = jnp.argmin(jnp.where(valid, sizes, jnp.iinfo(jnp.int32).max))
        full = (sizes[s] >= self.queue) | ~valid[s]
        do = ok & ~full
        slot = (state.head[j, s] + jnp.minimum(sizes[s], self.queue - 1)) % self.queue
        # (an index past the ring drops the write, and reads nothing: the update stays in
        # place inside the loop)
        slot = jnp.where(do, slot, self.queue)
        new_origin = state.origin.at[j, s, slot].set(origin, mode="drop")
        size = state.size.at[j, s].add(do.astype(jnp.int32))
        return ServersState(new_origin, state.head, size, state.active), ok & full

    def complete(self, state, j, u, t, ok):
        busy = (state.size[j] > 0).astype(jnp.int32)
        nb = jnp.sum(busy)
        do = ok & (nb > 0)
        # The (floor(u nb))-th busy server, each busy server equally likely: all serve at
        # the same rate, so this is the competing-exponentials choice.
        m = jnp.minimum(jnp.floor(u * nb).astype(jnp.int32), jnp.maximum(nb - 1, 0))
        s = jnp.searchsorted(jnp.cumsum(busy), m, side="right", method="compare_all")
        s = jnp.minimum(s, self.max_servers - 1)
        h = state.head[j, s]
        leaving = state.origin[j, s, h]
        d = do.astype(jnp.int32)
        head = state.head.at[j, s].set((h + d) % self.queue)
        size = state.size.at[j, s].add(-d)
        return ServersState(state.origin, head, size, state.active), leaving, ok
